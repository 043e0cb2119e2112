"""Tool calls on draftwise serve: reading calls out of text (whole and streamed), the grammar that forces a call,
the prompt a template with tools (Qwen2.5's) and one without (SmolLM2's, the tiny one's) gets, and the API end to
end through the openai client and LangChain, with the 400s of what cannot be served.

The end-to-end tests run a random tiny model: whatever it would write, the grammar makes its reply a valid call.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from conftest import tiny_tokenizer
from draftwise.grammar import GrammarCompiler
from draftwise.models.store import ModelStoreError, model_path
from draftwise.serve.protocol import parse
from draftwise.serve.tools import CallReader, Function, ToolRequest, call_grammar, split_calls
from test_structured_output import MODEL, client, refused, serving, tiny_engine

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MAX_TOKENS = 300  # a call of the tiny tokenizer's is about 100 tokens; a few in parallel fit


def calls_of(items):
    return [(value["function"]["name"], value["function"]["arguments"]) for kind, value in items if kind == "call"]


def content_of(items):
    return "".join(value for kind, value in items if kind == "content")


def block(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# -- reading calls out of text -------------------------------------------------------------------------------------

TEXTS = [
    "Let me check. " + block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {"zone": "UTC"}) + " Done.",
    block("get_weather", {"city": "Oslo", "unit": "c"}),
    "no calls at all, < tool_call > nor <tool_ca",
    "<tool_call>\n{not json}\n</tool_call> then " + block("get_time", {}),
    "<tool_call>\n" + '{"name": "get_time", "arguments": {"zone": "CET"}}',  # cut short: never closed
    "<tool_call> <tool_call>\n" + '{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>  \n',
]


def test_several_calls_and_the_text_around_them():
    content, calls = split_calls(TEXTS[0])
    assert content == "Let me check. \n Done."  # the text between the blocks, trimmed at its ends
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert all(c["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_only_calls_is_no_content():
    content, calls = split_calls("\n" + TEXTS[1] + "\n")
    assert content is None and len(calls) == 1


def test_a_block_that_is_not_a_call_stays_text():
    content, calls = split_calls(TEXTS[3])
    assert content == "<tool_call>\n{not json}\n</tool_call> then" and calls_of([("call", c) for c in calls]) == [
        ("get_time", "{}")]
    for not_a_call in ('{"arguments": {}}', '["get_time"]', '{"name": "f", "arguments": [1]}'):
        text = f"<tool_call>\n{not_a_call}\n</tool_call>"
        assert split_calls(text) == (text, [])


def test_an_unclosed_block_stays_text_and_arguments_may_be_json_text():
    assert split_calls(TEXTS[4]) == (TEXTS[4], [])
    content, calls = split_calls(TEXTS[5])
    assert content == "<tool_call>" and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert split_calls(TEXTS[2]) == (TEXTS[2], [])


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_in_any_two_or_three_pieces_the_items_are_the_whole_texts(text):
    reader = CallReader()
    whole = reader.add(text) + reader.finish()
    cuts = [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(0, len(text), 7) for j in range(i, len(text))]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        reader = CallReader()
        items = [item for a, b in zip(bounds, bounds[1:]) for item in reader.add(text[a:b])] + reader.finish()
        assert content_of(items) == content_of(whole) and calls_of(items) == calls_of(whole), cut
        assert [kind for kind, _ in items if kind == "call"] == [kind for kind, _ in whole if kind == "call"]


def test_content_streams_before_the_reply_ends():
    reader = CallReader()
    assert reader.add("Checking the wea") == [("content", "Checking the wea")]
    assert reader.add("ther <tool_") == [("content", "ther")]  # the tail that may open a block waits
    assert reader.add('call>\n{"name": "f", "arguments": {}}\n') == []
    assert calls_of(reader.add("</tool_call>")) == [("f", "{}")]


# -- the grammar ---------------------------------------------------------------------------------------------------

def pulled(name: str):
    """A model's folder in the store, or None where it is not pulled (only its tokenizer is read here)."""
    try:
        return model_path(name)
    except ModelStoreError:
        return None


QWEN, SMOL = pulled("qwen2.5-coder-0.5b-instruct"), pulled("smollm2-135m-instruct")
needs_qwen = pytest.mark.skipif(QWEN is None, reason="qwen2.5-coder-0.5b-instruct is not in the store")
FUNCTIONS = (Function("get_weather", "The weather", WEATHER), Function("get_time", None, TIME))


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5's tokenizer (<tool_call> is a token of its own) and an llguidance view of it: no model is loaded."""
    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    return tokenizer, GrammarCompiler(tokenizer, 151936, frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")}))


def qwen_reply(tokenizer, calls) -> list[int]:
    """The ids of an assistant turn's calls as Qwen's own template writes them (the model was trained on those)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "?"},
                                         {"role": "assistant", "tool_calls": calls}], tokenize=True,
                                        return_dict=False)
    start = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=True, return_dict=False,
                                          add_generation_prompt=True)
    assert ids[: len(start)] == start
    return ids[len(start): ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"), len(start))]


def hf_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@needs_qwen
def test_required_parallel_calls_take_qwens_own_writing_of_them(qwen):
    tokenizer, compiler = qwen
    constraint = compiler.constraint(call_grammar(ToolRequest(FUNCTIONS, "required", None, True), True))
    reply = qwen_reply(tokenizer, [hf_call("get_weather", {"city": "Paris", "unit": "c"}),
                                   hf_call("get_time", {"zone": "UTC"})])
    assert reply[0] == tokenizer.convert_tokens_to_ids("<tool_call>")  # the token, not its letters
    assert constraint.allowed_prefix(reply) == len(reply)
    constraint.advance(reply)
    assert constraint.complete


@needs_qwen
def test_a_call_whose_arguments_break_the_schema_is_refused(qwen):
    tokenizer, compiler = qwen
    constraint = compiler.constraint(call_grammar(ToolRequest(FUNCTIONS, "required", None, True), True))
    for bad in (hf_call("get_weather", {"city": "Rome", "unit": "c"}), hf_call("get_weather", {"city": "Paris"}),
                hf_call("get_date", {})):
        reply = qwen_reply(tokenizer, [bad])
        assert constraint.allowed_prefix(reply) < len(reply)


@needs_qwen
def test_a_named_function_is_one_call_whose_frame_is_forced(qwen):
    tokenizer, compiler = qwen
    grammar = call_grammar(ToolRequest(FUNCTIONS, "function", "get_time", True), True)
    constraint = compiler.constraint(grammar)
    assert tokenizer.decode(constraint.forced()).startswith('<tool_call>\n{"name": "get_time", "arguments": {"')
    other = qwen_reply(tokenizer, [hf_call("get_weather", {"city": "Paris", "unit": "c"})])
    assert constraint.allowed_prefix(other) < len(other)
    one, two = (qwen_reply(tokenizer, [hf_call("get_time", {"zone": "UTC"})] * n) for n in (1, 2))
    assert constraint.allowed_prefix(one) == len(one) and constraint.allowed_prefix(two) == len(one)


@needs_qwen
def test_without_parallel_calls_required_is_one_call(qwen):
    tokenizer, compiler = qwen
    constraint = compiler.constraint(call_grammar(ToolRequest(FUNCTIONS, "required", None, False), True))
    two = qwen_reply(tokenizer, [hf_call("get_time", {"zone": "UTC"}), hf_call("get_time", {"zone": "CET"})])
    one = qwen_reply(tokenizer, [hf_call("get_time", {"zone": "UTC"})])
    assert constraint.allowed_prefix(two) == len(one)


@needs_qwen
def test_auto_with_a_response_schema_is_that_json_or_calls(qwen):
    tokenizer, compiler = qwen
    grammar = call_grammar(ToolRequest(FUNCTIONS, "auto", None, True), True, or_schema=TIME)
    for reply in (qwen_reply(tokenizer, [hf_call("get_time", {"zone": "UTC"})]),
                  tokenizer('{"zone": "CET"}')["input_ids"]):
        assert compiler.constraint(grammar).allowed_prefix(reply) == len(reply)
    assert call_grammar(ToolRequest(FUNCTIONS, "auto", None, True), True) is None  # auto alone: free text


def test_a_tokenizer_without_the_tokens_gets_the_frame_as_text_and_definitions_resolve():
    """The tiny tokenizer spells <tool_call>; parameters with $defs (as pydantic writes them) keep their references."""
    tokenizer = tiny_tokenizer()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    defs = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Zone"}}, "required": ["at"],
            "$defs": {"Zone": {"enum": ["UTC", "CET"]}}}
    grammar = call_grammar(ToolRequest((Function("when", None, defs),), "required", None, True), False)
    good, bad = (tokenizer(block("when", {"at": zone}))["input_ids"] for zone in ("CET", "PST"))
    assert compiler.constraint(grammar).allowed_prefix(good) == len(good)
    assert compiler.constraint(grammar).allowed_prefix(bad) < len(bad)


# -- the prompt ----------------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
]


def rendered(tokenizer, body) -> str:
    """The prompt the server builds for a chat body, as text (an engine of only what parse reads of one)."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    engine = SimpleNamespace(tokenizer=tokenizer, max_context=32768, readable_ids=len(tokenizer), drafts_available=(),
                             methods_available=("none",), grammars=compiler, check_limits=lambda *_: None)
    ids = parse({"model": "m", **body}, engine, "m", chat=True).prompt_ids
    return tokenizer.decode(ids)


@needs_qwen
def test_qwens_template_gets_the_tools_and_writes_the_history_calls(qwen):
    tokenizer, _ = qwen
    text = rendered(tokenizer, {"messages": HISTORY, "tools": TOOLS})
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n21 degrees\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "<tools>" not in rendered(tokenizer, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})


@pytest.mark.skipif(SMOL is None, reason="smollm2-135m-instruct is not in the store")
def test_a_template_without_tools_gets_them_as_instructions_and_the_history_as_text():
    """SmolLM2's template names no tools: the server writes Qwen's instructions and format."""
    smol = AutoTokenizer.from_pretrained(SMOL)
    text = rendered(smol, {"messages": [{"role": "system", "content": "Be brief."}, *HISTORY], "tools": TOOLS})
    assert "Be brief.\n\n# Tools\n" in text and json.dumps(TOOLS[1], ensure_ascii=False) in text
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n21 degrees\n</tool_response>" in text
    assert "# Tools" not in rendered(smol, {"messages": HISTORY})  # the history alone renders, without instructions


def test_a_template_without_a_system_role_gets_the_instructions_in_the_first_turn():
    text = rendered(tiny_tokenizer(), {"messages": HISTORY, "tools": TOOLS})  # (its template knows user, assistant)
    assert text.startswith("<|user|># Tools\n") and "</tool_call>\n\nWeather in Paris?<|end|>" in text
    assert "<|user|><tool_response>\n21 degrees\n</tool_response><|end|>" in text


# -- end to end, on a tiny random model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url():
    with serving(tiny_engine(), MODEL) as url:
        yield url


def ask(url, **options):
    options = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "temperature": 0,
               "max_tokens": MAX_TOKENS, "tools": TOOLS, **options}
    return client(url).chat.completions.create(**options)


def check_calls(calls, names=SCHEMAS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True),
                                              ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_a_forced_call_is_tool_calls_whose_arguments_validate(url, choice, parallel):
    reply = ask(url, tool_choice=choice, parallel_tool_calls=parallel)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    check_calls(message.tool_calls, ["get_time"] if isinstance(choice, dict) else SCHEMAS)
    if not parallel or isinstance(choice, dict):
        assert len(message.tool_calls) == 1


def test_streamed_calls_are_deltas_that_gather_into_the_whole_replys(url):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = ask(url, tool_choice=choice).choices[0].message.tool_calls
    chunks = list(ask(url, tool_choice=choice, stream=True))
    deltas = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole)]
    assert all(d.id.startswith("call_") and d.type == "function" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client(url).chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                             temperature=0, max_tokens=MAX_TOKENS, tools=TOOLS,
                                             tool_choice=choice) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_a_history_of_calls_and_results_is_taken(url):
    reply = ask(url, messages=HISTORY, tool_choice="required")
    check_calls(reply.choices[0].message.tool_calls)
    assert reply.usage.prompt_tokens > ask(url, tool_choice="required").usage.prompt_tokens


def test_jump_forward_drafts_the_frame_and_changes_no_call(url):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    on = ask(url, tool_choice=choice)
    off = ask(url, tool_choice=choice, extra_body={"speculation": {"jump_forward": False}})
    assert on.choices[0].message.tool_calls[0].function == off.choices[0].message.tool_calls[0].function
    assert on.model_extra["draftwise"]["forced_tokens"] > 0 == off.model_extra["draftwise"]["forced_tokens"]


def test_tool_choice_none_writes_text(url):
    reply = ask(url, tool_choice="none", max_tokens=12)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("options, param, says", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice", "get_weather, get_time"),
    ({"tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tools": {"get_weather": WEATHER}}, "tools", "list"),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "city"}}]}, "tools", "JSON schema"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
      "tool_choice": "required"}, "tools", "frobnicate"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city"}}]}]}, "messages", "JSON"),
])
def test_tools_that_cannot_be_served_are_a_400_naming_the_parameter(url, options, param, says):
    err = refused(lambda: ask(url, **options))
    assert err.body["param"] == param and says in err.body["message"], err.body


def test_tools_on_the_completions_endpoint_are_refused(url):
    err = refused(lambda: client(url).completions.create(model=MODEL, prompt="x", extra_body={"tools": TOOLS}))
    assert err.body["param"] == "tools" and "/v1/chat/completions" in err.body["message"]


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Oslo"] = Field(description="the city")
    unit: Literal["c", "f"]


def test_langchain_bind_tools_gets_tool_calls_whole_and_streamed(url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="x", model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
                     max_retries=0, timeout=60).bind_tools([GetWeather], tool_choice="GetWeather")
    message = llm.invoke("Weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
    GetWeather(**message.tool_calls[0]["args"])
    gathered = None
    for chunk in llm.stream("Weather in Paris?"):
        gathered = chunk if gathered is None else gathered + chunk
    assert [(c["name"], c["args"]) for c in gathered.tool_calls] == [(c["name"], c["args"]) for c in message.tool_calls]
    assert gathered.response_metadata.get("finish_reason") == "tool_calls"
