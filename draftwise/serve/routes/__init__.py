"""The HTTP routes, a router per concern: completions and chat (completions.py), the server's status (status.py),
the dashboard (dashboard.py) and the draft trials (admin.py). app.create_app assembles them; each route reads the
server's parts from app.state (state.py), never from create_app's locals."""
