"""The server: OpenAI-compatible HTTP (app.py) over a scheduler that batches every running request (scheduler.py)."""
