"""`response_format` on draftwise serve: JSON mode and JSON schemas, whole and streamed, on both endpoints, through
the official openai client and LangChain, and the 400s of what cannot be served.

A random tiny model writes gibberish: it shows that the grammar alone makes the reply valid (with bounded schemas,
so that it ends). SmolLM2 (the store's, `real_model`) shows the clients' own parsing on a model that writes sense.
"""
from __future__ import annotations

import contextlib
import json
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_tokenizer
from draftwise import Engine
from draftwise.serve.app import create_app
from draftwise.serve.command import serve_in_thread
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.protocol import RequestError, parse
from draftwise.serve.scheduler import Scheduler

MODEL = "tiny"
# Everything in it is bounded (enums, lengths, a range): a random model's reply ends within the tokens allowed.
PLACE = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "capital": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 4},
        "tags": {"type": "array", "items": {"enum": ["old", "new"]}, "maxItems": 2},
    },
    "required": ["city", "capital", "note", "tags"],
    "additionalProperties": False,
}
# The tiny tokenizer spends several tokens on a character, and the grammar lets up to 21 characters of whitespace
# between JSON tokens (grammar.py): PLACE's longest reply fits.
BOUNDED_TOKENS = 800


def tiny_long_model(seed: int, layers: int = 2):
    """conftest's tiny model with room for a tool list's instructions (about 600 tiny tokens): 2048 positions."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # (sharp logits, as conftest's: no greedy ties)
    return model


def tiny_engine() -> Engine:
    return Engine.from_models(tiny_long_model(0), tiny_tokenizer(), draft_model=tiny_long_model(1, 1), method="draft")


@contextlib.contextmanager
def serving(engine: Engine, model_id: str):
    """The engine behind `draftwise serve`'s app on a free port of 127.0.0.1; the base URL."""
    metrics = ServeMetrics()
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=256, metrics=metrics)
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, model_id, metrics))
    try:
        yield url
    finally:
        stop()
        scheduler.drain(5)


def client(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)


def schema_format(schema: dict, name: str = "place") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def refused(call) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value


@pytest.fixture(scope="module")
def tiny_url():
    with serving(tiny_engine(), MODEL) as url:
        yield url


def chat(url, **options):
    options = {"model": MODEL, "messages": [{"role": "user", "content": "Where?"}], "temperature": 0,
               "max_tokens": BOUNDED_TOKENS, **options}
    return client(url).chat.completions.create(**options)


# -- the tiny model: the grammar alone makes the reply valid -------------------------------------------------------

def test_a_json_schema_reply_validates_whole_and_streamed(tiny_url):
    whole = chat(tiny_url, response_format=schema_format(PLACE))
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PLACE)
    chunks = list(chat(tiny_url, response_format=schema_format(PLACE), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_without_the_grammar_the_same_model_writes_no_json(tiny_url):
    """The control: the tiny model's own reply to the same request is not JSON, so the test above can fail."""
    text = chat(tiny_url, max_tokens=40).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(text)


def test_completions_take_response_format_whole_and_streamed(tiny_url):
    options = dict(model=MODEL, prompt="The quick brown fox", max_tokens=BOUNDED_TOKENS, temperature=0,
                   extra_body={"response_format": schema_format(PLACE)})
    whole = client(tiny_url).completions.create(**options)
    jsonschema.validate(json.loads(whole.choices[0].text), PLACE)
    streamed = list(client(tiny_url).completions.create(**options, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_a_text_response_format_is_free_text(tiny_url):
    free = chat(tiny_url, max_tokens=12)
    text = chat(tiny_url, max_tokens=12, response_format={"type": "text"})
    assert text.choices[0].message.content == free.choices[0].message.content


def test_jump_forward_changes_no_reply(tiny_url):
    """Drafting the tokens the grammar forces is a speed-up only: the greedy reply is the same without it."""
    on = chat(tiny_url, response_format=schema_format(PLACE))
    off = chat(tiny_url, response_format=schema_format(PLACE), extra_body={"speculation": {"jump_forward": False}})
    jsonschema.validate(json.loads(on.choices[0].message.content), PLACE)
    assert on.choices[0].message.content == off.choices[0].message.content


@pytest.mark.parametrize("response_format, says", [
    ({"type": "yaml"}, "json_schema"),
    ("json", "json_object"),
    ({"type": "json_schema"}, "'response_format.json_schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": PLACE}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": PLACE, "format": 1}}, "format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}, "frobnicate"),
])
def test_a_response_format_that_cannot_be_served_is_a_400_naming_it(tiny_url, response_format, says):
    err = refused(lambda: chat(tiny_url, response_format=response_format))
    assert err.body["param"] == "response_format" and says in err.body["message"]


def test_a_response_format_and_a_forced_tool_call_cannot_both_hold(tiny_url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    err = refused(lambda: chat(tiny_url, response_format={"type": "json_object"}, tools=tools,
                               tool_choice="required"))
    assert err.body["param"] == "response_format"


def test_speculation_jump_forward_reaches_the_grammar_and_is_checked():
    engine = tiny_engine()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Where?"}],
            "response_format": schema_format(PLACE)}
    assert parse(body, engine, MODEL, chat=True).cfg.grammar.jump_forward is True
    off = parse({**body, "speculation": {"jump_forward": False}}, engine, MODEL, chat=True)
    assert off.cfg.grammar.jump_forward is False
    with pytest.raises(RequestError, match="jump_forward") as caught:
        parse({**body, "speculation": {"jump_forward": "no"}}, engine, MODEL, chat=True)
    assert caught.value.param == "speculation.jump_forward"
    with pytest.raises(RequestError, match="allowed: method, num_draft_tokens, adaptive, jump_forward"):
        parse({**body, "speculation": {"jump": True}}, engine, MODEL, chat=True)
    assert parse({**body, "response_format": None}, engine, MODEL, chat=True).cfg.grammar is None


# -- SmolLM2: the clients' own parsing ------------------------------------------------------------------------------

SMOL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Describe Paris as a JSON object with keys city and country."}]


class Place(BaseModel):
    city: str


class Rated(BaseModel):
    city: str
    rating: Literal["good", "bad"]


@pytest.fixture(scope="module")
def smol_url():
    from test_real_model import loaded

    model, tokenizer = loaded()
    with serving(Engine.from_models(model, tokenizer, method="lookup"), SMOL) as url:
        yield url


@pytest.mark.real_model
def test_json_mode_replies_are_json_objects_whole_and_streamed(smol_url):
    options = dict(model=SMOL, messages=ASK, max_tokens=80, temperature=0, response_format={"type": "json_object"})
    whole = client(smol_url, 120).chat.completions.create(**options)
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    chunks = list(client(smol_url, 120).chat.completions.create(**options, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


@pytest.mark.real_model
def test_the_openai_clients_parse_and_stream_helpers_read_a_schema_reply(smol_url):
    parsed = client(smol_url, 120).chat.completions.parse(model=SMOL, messages=ASK, max_tokens=80, temperature=0,
                                                          response_format=Rated)
    assert isinstance(parsed.choices[0].message.parsed, Rated)
    jsonschema.validate(json.loads(parsed.choices[0].message.content), Rated.model_json_schema())
    with client(smol_url, 120).chat.completions.stream(model=SMOL, messages=ASK, max_tokens=80, temperature=0,
                                                       response_format=Rated) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == parsed.choices[0].message.parsed


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["json_mode", "json_schema"])
def test_langchain_structured_output(smol_url, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{smol_url}/v1", api_key="x", model=SMOL, temperature=0, max_tokens=80, max_retries=0,
                     timeout=120)
    # (json_mode sends no schema: only the prompt asks for the key, which the model writes)
    place = llm.with_structured_output(Place, method=method).invoke(ASK)
    assert isinstance(place, Place) and place.city
