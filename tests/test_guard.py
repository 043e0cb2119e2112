"""The guard: text is held back by a window, a blocked phrase split across tokens never leaves the server."""
from __future__ import annotations

import openai
import pytest

from conftest import tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.errors import DraftwiseError
from draftwise.serve.app import create_app
from draftwise.serve.command import serve_in_thread
from draftwise.serve.guard import Guard, load_guard
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.scheduler import Scheduler

PROMPT = "The quick brown fox"
TOKENS = 24


def block_secrets(request: dict, text: str):
    """A --guard function for the tests: blocks what the request's "forbid" field names."""
    return "block" if request.get("forbid") and request["forbid"] in text else "allow"


def block_secrets_or_raise(request: dict, text: str):
    """Like block_secrets, but broken for requests that ask it to be."""
    if request.get("break_guard"):
        raise ValueError("the guard's backend is down")
    return block_secrets(request, text)


def reference_text() -> str:
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="none")
    return engine.generate(PROMPT, max_new_tokens=TOKENS).text


def test_a_phrase_split_across_pieces_is_caught_before_any_of_it_leaves():
    guarded = Guard(pattern=load_guard(None, r"bad\s+word").pattern, window=12).stream({})
    sent = []
    for piece in ["Some ", "fine text ", "and then", " ba", "d w", "ord", " more"]:
        out = guarded.add(piece)
        if out is None:
            break
        sent.append(out)
    assert guarded.blocked and "".join(sent) == "Some fine text and"[: len("".join(sent))]
    assert "b" not in "".join(sent).replace("Some fine text and", "")


def test_the_regex_looks_back_a_bounded_reach_and_the_end_checks_the_whole_text(monkeypatch):
    # Each piece is searched from REGEX_REACH characters back: a long reply's checks stay linear. A match that starts
    # further back (longer than the reach) is still caught by the final check of the whole text.
    monkeypatch.setattr("draftwise.serve.guard.REGEX_REACH", 16)
    searched = []
    pattern = load_guard(None, r"(?s)begin.*end").pattern

    class Recording:
        def search(self, text, pos=0):
            searched.append(len(text) - pos)
            return pattern.search(text, pos)

    guarded = Guard(pattern=Recording(), window=4).stream({})
    pieces = ["begin ", *["filler " * 3] * 20, "the end"]
    out = [guarded.add(piece) for piece in pieces[:-1]]
    assert all(part is not None for part in out) and max(searched) <= 16 + len(pieces[1])  # never the whole text
    assert guarded.add(pieces[-1], final=True) is None and guarded.blocked  # the whole text, at the end
    lookbehind = Guard(pattern=load_guard(None, r"(?<=bad )word").pattern, window=4).stream({})
    assert lookbehind.add("a bad ") is not None and lookbehind.add("word") is None  # (pos keeps what lies before)


def test_an_allowed_text_is_released_whole_at_the_end():
    guarded = Guard(pattern=load_guard(None, "never-there").pattern, window=8).stream({})
    pieces = ["one ", "two ", "three ", "four"]
    out = [guarded.add(p) for p in pieces[:-1]] + [guarded.add(pieces[-1], final=True)]
    assert "".join(out) == "".join(pieces) and out[0] == ""  # the first piece waited for the window


@pytest.mark.parametrize("spec,regex,message", [
    ("no_colon", None, "must be module:function"),
    ("no_such_module_here:check", None, "cannot import it"),
    ("test_guard:TOKENS", None, "is not a function"),
    (None, "([unclosed", "not a valid regular expression"),
])
def test_bad_guard_options_say_what_is_wrong(spec, regex, message):
    with pytest.raises(DraftwiseError, match=message):
        load_guard(spec, regex)


@pytest.fixture(scope="module")
def guarded_server():
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                                method="draft")
    metrics = ServeMetrics()
    guard = load_guard("test_guard:block_secrets_or_raise", None, window=40)
    scheduler = Scheduler(engine, prefill_chunk=4, metrics=metrics, guard=guard)
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, "tiny", metrics))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30), metrics
    stop()
    scheduler.drain(5)


def _ask(client, stream, forbid=None):
    extra = {"forbid": forbid} if forbid else {}
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=stream,
                                     extra_body=extra)


@pytest.mark.parametrize("stream", [False, True])
def test_a_blocked_phrase_spanning_tokens_is_never_streamed(guarded_server, stream):
    client, metrics = guarded_server
    full = reference_text()
    phrase = full[len(full) // 3: len(full) // 3 + 12]  # a dozen characters from the middle: several tokens
    blocks_before = metrics.registry.get_sample_value("draftwise_guard_blocks_total", {"arm": ""})
    response = _ask(client, stream, forbid=phrase)
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        text, finish = response.choices[0].text, [response.choices[0].finish_reason]
    assert finish == ["content_filter"]
    start = full.index(phrase)
    assert full.startswith(text) and len(text) <= start  # nothing from the phrase on left the server
    assert metrics.registry.get_sample_value("draftwise_guard_blocks_total", {"arm": ""}) == blocks_before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_allowed_response_is_the_whole_text(guarded_server, stream):
    client, _ = guarded_server
    response = _ask(client, stream, forbid="this phrase is not in the output at all")
    if stream:
        text = "".join(c.choices[0].text for c in response if c.choices)
    else:
        text = response.choices[0].text
    assert text == reference_text()[: len(text)] and len(text) > 0


def test_a_guard_that_raises_ends_only_its_request_and_sends_nothing_it_did_not_pass(guarded_server):
    client, _ = guarded_server
    with pytest.raises(openai.InternalServerError, match="the guard raised ValueError"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                  extra_body={"break_guard": True})
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True,
                                       extra_body={"break_guard": True})
    pieces = []
    with pytest.raises(openai.APIError, match="the guard raised"):
        for chunk in stream:
            pieces.extend(c.text for c in chunk.choices)
    assert "".join(pieces) == ""  # the guard passed nothing before it broke, so nothing left
    assert _ask(client, False).choices[0].text == reference_text()  # the server goes on
