"""Tool calls on the chat API: the request's `tools`, their place in the prompt, the grammar that forces a call, and
the calls read back out of the generated text.

The format is Hermes's, which Qwen2.5 is trained on and its chat template writes:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders tools itself (it names `tools`) gets them, and the history's calls, as `tools=` and as
assistant `tool_calls` in the shape Hugging Face templates read. Any other chat model gets the same instructions as a
system message, and its history's calls and results as text in that format: its output is read the same way.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from draftwise.grammar import JSON_STYLE, Grammar
from draftwise.request_text import known_roles
from draftwise.serve.request_error import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI's API
CHOICES = ("none", "auto", "required")
# The tool instructions for a template that has none of its own: Qwen2.5's, word for word.
TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict

    def definition(self) -> dict:
        """OpenAI's tool entry, which is also what Hugging Face chat templates read."""
        described = {"description": self.description} if self.description is not None else {}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools. choice: "none" (the model is not told of them and nothing is read as a call),
    "auto" (it may call), "required" (it must: one call, or with parallel several), or "function" (one call of
    `named`)."""

    functions: tuple[Function, ...]
    choice: str
    named: str | None
    parallel: bool

    @property
    def offered(self) -> bool:
        """The tools are in the prompt and the output is read for calls."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output is held to calls by a grammar."""
        return self.choice in ("required", "function")


# -- the request ---------------------------------------------------------------------------------------------------

def read_tool_request(body: dict, chat: bool) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None when the request has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise RequestError("'tool_choice' needs 'tools': name the functions it may call", "tool_choice")
        return None
    if not chat:
        raise RequestError("'tools' are only supported on /v1/chat/completions", "tools")
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {name, description, "
                           "parameters}}", "tools")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise RequestError(f"'tools' names a function twice: {sorted({n for n in names if names.count(n) > 1})}",
                           "tools")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise RequestError(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
    kind, named = _choice(choice, names)
    return ToolRequest(functions, kind, named, parallel)


def _function(tool, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise RequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{name, description, "
                           "parameters}}}}", "tools")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:  # (OpenAI's default: a function of no parameters)
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError(f"{where}.function.parameters must be a JSON schema object", "tools")
    return Function(name, description, parameters)


def _choice(choice, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in CHOICES:
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\", or {\"type\": \"function\", "
                           "\"function\": {\"name\": NAME}}", "tool_choice")
    if function["name"] not in names:
        raise RequestError(f"'tool_choice' names the function {function['name']!r}, which is not in 'tools' "
                           f"({', '.join(names)})", "tool_choice")
    return "function", function["name"]


def read_history_calls(value, where: str) -> list[dict]:
    """An assistant message's `tool_calls` (OpenAI's: arguments as JSON text) -> Hugging Face's (arguments as the
    parsed value, which templates write with `tojson`)."""
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a list of {{id, type: \"function\", function: {{name, arguments}}}}",
                           "messages")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}[{j}] must be {{id, type: \"function\", function: {{name, arguments}}}}",
                               "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as err:
                raise RequestError(f"{where}[{j}].function.arguments must be JSON text: {err}", "messages") from err
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls


# -- the prompt ----------------------------------------------------------------------------------------------------

def renders_tools(template: str) -> bool:
    """Whether a chat template writes tools itself (Qwen2.5's does; SmolLM2's does not)."""
    return re.search(r"\btools\b", template) is not None


def prompt_messages(messages: list[dict], definitions: list[dict] | None,
                    template: str) -> tuple[list[dict], list | None]:
    """(messages, tools= for the template). messages: the request's, checked, in Hugging Face's shape (assistant
    `tool_calls` with parsed arguments; `tool` messages); definitions: the tools offered (Function.definition), if
    any. For a template that does not render tools, the tools become instructions in the system message and the
    history's calls and results become text."""
    if renders_tools(template):
        return messages, definitions
    plain = _calls_as_text(messages)
    if definitions:
        plain = _with_instructions(plain, _tools_text(definitions), "system" in known_roles(template))
    return plain, None


def _tools_text(definitions: list[dict]) -> str:
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(d, ensure_ascii=False) for d in definitions))


def _calls_as_text(messages: list[dict]) -> list[dict]:
    """Assistant calls as <tool_call> blocks after their content; tool results as a user turn of <tool_response>
    blocks (consecutive results in one turn, as Qwen's template writes them)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
            else:
                out.append({"role": "user", "content": response, "tool_results": True})
        elif m.get("tool_calls"):
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), *blocks]))})
        else:
            out.append(m)
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _with_instructions(messages: list[dict], text: str, system_role: bool) -> list[dict]:
    """The tool instructions in the system message (after its own text), or one of their own; a template without a
    system role gets them at the head of the first message."""
    first, rest = messages[0], messages[1:]
    if first["role"] == "system":
        return [{**first, "content": "\n\n".join(filter(None, [first["content"], text]))}, *rest]
    if not system_role:
        return [{**first, "content": "\n\n".join(filter(None, [text, first["content"]]))}, *rest]
    return [{"role": "system", "content": text}, *messages]


def call_text(name: str, arguments) -> str:
    """One call as the model writes it (and as Qwen's template writes a history's call)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


# -- the grammar ---------------------------------------------------------------------------------------------------

def call_grammar(tools: ToolRequest, frame_tokens: bool, or_schema: dict | None = None) -> Grammar | None:
    """The Lark grammar of what a request's output may be: for "required" one call of any of the functions (one
    or more, "\\n" apart, with parallel calls), for "function" one call of it; for "auto" with a response schema,
    that JSON or calls. None where the output is free. frame_tokens: the tokenizer has <tool_call> and
    </tool_call> as tokens of their own (Qwen's), which the grammar then names, as the model writes them."""
    if not tools.forced and or_schema is None:
        return None
    functions = [f for f in tools.functions if tools.choice != "function" or f.name == tools.named]
    several = tools.parallel and tools.choice != "function"
    open_, close = ("<tool_call>", "</tool_call>") if frame_tokens else ('"<tool_call>"', '"</tool_call>"')
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    rules = ["calls: call" + (' ("\\n" call)*' if several else ""),
             f'call: {open_} "\\n" ({alternatives}) "\\n" {close}']
    rules += [f"call_{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(functions)]
    start = "start: calls" if or_schema is None else f"start: calls | %json {json.dumps(or_schema)}"
    return Grammar.lark("\n".join([start, *rules]) + "\n")


def _call_schema(function: Function) -> dict:
    """{"name": the function's name, "arguments": its parameters}, as one JSON schema. The parameters' own
    definitions move to the root, where their references ("#/$defs/...") point."""
    parameters = dict(function.parameters)
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {"type": "object", "properties": {"name": {"const": function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False, **definitions,
            "x-guidance": JSON_STYLE}


# -- the output ----------------------------------------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_call(block: str) -> dict | None:
    """A <tool_call> block -> OpenAI's tool call, or None where it does not hold {"name": str, "arguments": object}
    (its text is then kept as content)."""
    inner = block[len(OPEN):-len(CLOSE)].strip()
    try:
        call = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # (some models write the arguments as JSON text, as OpenAI's API carries them)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class CallReader:
    """Generated text, piece by piece -> ("content", text) and ("call", tool call) items, in order.

    Text outside <tool_call> blocks is content, trimmed of the whitespace at its ends (between calls, around
    them): content streams at once but for a tail that might still open a block, or be trailing whitespace. A
    block whose JSON is not a call is content as written. Streamed or whole (add(text) then finish()), a text
    gives the same items."""

    def __init__(self):
        self._pending = ""  # text not yet read: an open block, or a tail that may begin one
        self._searched = 0  # how much of an open block was searched for its end (a long one is not searched again)
        self._space = ""  # whitespace held back: shown only if more content follows it
        self._started = False  # content has been shown (leading whitespace is dropped)

    def add(self, text: str) -> list[tuple[str, object]]:
        self._pending += text
        items: list[tuple[str, object]] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_open(self._pending)
                items += self._content(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return items
            if start:
                items += self._content(self._pending[:start])
                self._pending, self._searched = self._pending[start:], 0
            close, reopened = (self._pending.find(tag, max(len(OPEN), self._searched - len(tag) + 1))
                               for tag in (CLOSE, OPEN))
            if 0 <= reopened and (close < 0 or reopened < close):  # a block opened again before it closed
                items += self._content(self._pending[:reopened])
                self._pending, self._searched = self._pending[reopened:], 0
                continue
            if close < 0:
                self._searched = len(self._pending)
                return items  # the block is still being written
            block, self._pending = self._pending[: close + len(CLOSE)], self._pending[close + len(CLOSE):]
            self._searched = 0
            call = read_call(block)
            items += [("call", call)] if call is not None else self._content(block)

    def finish(self) -> list[tuple[str, object]]:
        """The rest: an unclosed block or held tail is content (trailing whitespace is dropped)."""
        items, self._pending = self._content(self._pending), ""
        return items

    def _content(self, text: str) -> list[tuple[str, object]]:
        self._space += text
        body = self._space.rstrip()
        if not body.strip():
            return []  # whitespace only, so far
        shown = body if self._started else body.lstrip()
        self._started, self._space = True, self._space[len(body):]
        return [("content", shown)]


def _partial_open(text: str) -> int:
    """How many characters at the end of text could begin <tool_call>."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole text -> (content, or None where there is none; its tool calls)."""
    reader = CallReader()
    items = reader.add(text) + reader.finish()
    content = "".join(value for kind, value in items if kind == "content")
    return content or None, [value for kind, value in items if kind == "call"]
