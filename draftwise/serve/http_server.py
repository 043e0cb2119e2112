"""The single process's HTTP server: uvicorn (the `serve` extra), draining on SIGTERM before it stops."""
from __future__ import annotations

import signal
import threading

import uvicorn


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM or Ctrl-C: keep listening (new requests get 503), let the running ones finish up to
    the drain timeout, then shut down. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, scheduler, drain_timeout: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout = scheduler, drain_timeout
        self._draining = False

    def run_then_stop(self) -> None:
        """Serve HTTP until told to exit (or until the port cannot be had), then stop the model loop."""
        try:
            self.run()
        finally:
            self.scheduler.drain(0 if self.force_exit or not self.started else self.drain_timeout)

    def handle_exit(self, sig: int, frame) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        if self._draining:  # a second signal: stop now, without waiting for open connections
            self.force_exit = True
            threading.Thread(target=self.scheduler.drain, args=(0,), daemon=True, name="draftwise-stop").start()
            return super().handle_exit(sig, frame)
        # uvicorn's own shutdown would close the listening socket first (new requests would get "connection
        # refused", not 503) and wait on open streams with no limit; so drain the scheduler first, listening.
        self._draining = True
        threading.Thread(target=self._drain_then_exit, daemon=True, name="draftwise-drain").start()

    def _drain_then_exit(self) -> None:
        self.scheduler.drain(self.drain_timeout)
        self.should_exit = True
