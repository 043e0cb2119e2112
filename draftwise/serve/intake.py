"""A request's body -> (JSON, Parsed), on a thread of its own: neither the event loop nor the model loop waits on it.

Reading JSON, checking it, rendering a chat template and tokenizing take time that grows with the body. On the event
loop, one large body held up every other request's tokens and even `/health`. Here they run on one worker thread,
one request at a time: the fast tokenizer switches settings per call (which special tokens it splits) and must not
be switched while another call encodes. What each request may cost is bounded before the work (protocol.py:
the body's bytes, the number of messages, the characters per context position).

The engine's own checks of the request (its context, then check_open) are the engine's methods, whose one caller is
the model loop: they go to it as one job (Scheduler.call), awaited here, so that their errors come back to the request
as before, and the loop holds the batch's door for the submit that follows.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from draftwise.serve.protocol import Parsed, RequestError, parse_deferring_context


class Intake:
    def __init__(self, scheduler, model_id: str, speculation: dict | None = None, experiment=None,
                 trust_special_tokens: bool = False):
        self.scheduler, self.engine = scheduler, scheduler.engine
        self.model_id, self.speculation = model_id, speculation
        self.experiment, self.trust_special_tokens = experiment, trust_special_tokens
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="draftwise-intake")

    async def parse(self, raw: bytes, chat: bool) -> tuple[object, Parsed]:
        """The body's JSON and what it asks for, checked by the engine; raises RequestError for a body the server
        refuses, DraftwiseError for a request the engine cannot open, ShuttingDown once the model loop has stopped."""
        body, parsed, check_context = await asyncio.get_running_loop().run_in_executor(self._worker, self._parse, raw,
                                                                                       chat)

        def check() -> None:  # on the model loop
            check_context()
            self.engine.check_open(parsed.prompt_ids, parsed.cfg)  # (the one Scheduler.submit ran on the HTTP side)

        await asyncio.wrap_future(self.scheduler.call(check, before_submit=True))
        return body, parsed

    def _parse(self, raw: bytes, chat: bool):
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:  # (a bad encoding, an integer of 5,000 digits, deep nests)
            raise RequestError(f"the body is not valid JSON: {err}", code="invalid_json",
                               reason="invalid_json") from err
        parsed, check_context = parse_deferring_context(body, self.engine, self.model_id, chat, self.speculation,
                                                        self.experiment, self.trust_special_tokens)
        return body, parsed, check_context

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
