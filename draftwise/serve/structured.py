"""What a request's output must match: its `response_format` and its tool choice, as one grammar (grammar.py).

The engine masks the target's logits with the grammar at every position it verifies, so a reply that ends by
itself (not by max_tokens) always matches: `strict` is accepted either way and always holds. Between a reply's JSON
tokens goes what grammar.JSON_STYLE allows: the JSON is on one line, as a tool call's is.
"""
from __future__ import annotations

from dataclasses import dataclass

from draftwise.errors import DraftwiseError
from draftwise.grammar import JSON_OBJECT_SCHEMA, JSON_STYLE, Grammar
from draftwise.serve.request_error import RequestError
from draftwise.serve.tools import ToolRequest, call_grammar

FORMATS = '{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": {name, schema, strict}}'
JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")  # OpenAI's


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "json_object" or "json_schema"
    schema: dict  # the JSON schema of the whole reply


def read_response_format(value) -> ResponseFormat | None:
    """The request's `response_format`, checked; None for free text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(kind, JSON_OBJECT_SCHEMA)
    if kind != "json_schema":
        raise RequestError(f"'response_format' must be {FORMATS}; got type {kind!r}", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("'response_format.json_schema' must be an object {name, schema, strict}", "response_format")
    unknown = set(spec) - set(JSON_SCHEMA_FIELDS)
    if unknown:
        raise RequestError(f"unknown 'response_format.json_schema' fields: {', '.join(sorted(unknown))}; allowed: "
                           f"{', '.join(JSON_SCHEMA_FIELDS)}", "response_format")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise RequestError("'response_format.json_schema.name' must be a non-empty string", "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise RequestError("'response_format.json_schema.strict' must be true or false", "response_format")
    schema = spec.get("schema", JSON_OBJECT_SCHEMA)  # (OpenAI's default: any object)
    if not isinstance(schema, dict):
        raise RequestError("'response_format.json_schema.schema' must be a JSON schema object", "response_format")
    return ResponseFormat(kind, schema)


def output_grammar(response: ResponseFormat | None, tools: ToolRequest | None, frame_tokens: bool,
                   jump_forward: bool, check) -> Grammar | None:
    """The one grammar of a request's output, checked by check(grammar) (the engine's compile, which raises
    DraftwiseError saying why), or None for free text. A forced tool call and a response format cannot both hold;
    with tool_choice "auto" the reply is that JSON or calls. frame_tokens: see tools.call_grammar."""
    if tools is not None and tools.forced and response is not None:
        raise RequestError("'response_format' cannot be combined with a tool_choice that forces a call (\"required\" "
                           "or a named function): the reply is the call", "response_format")
    offered = tools is not None and tools.offered
    if offered and (tools.forced or response is not None):
        if response is not None:  # its schema alone first: a fault in the calls' part is then the tools'
            _checked(_schema_grammar(response.schema), "response_format", check)
        either = None if response is None else _one_line(response.schema)
        grammar, param = call_grammar(tools, frame_tokens, either), "tools"
    elif response is not None:
        grammar, param = _schema_grammar(response.schema, response.kind), "response_format"
    else:
        return None
    return _checked(grammar, param, check).with_jump_forward(jump_forward)


def _one_line(schema: dict) -> dict:
    """The schema in grammar.JSON_STYLE, which Grammar.json_schema gives a schema alone and a Lark grammar's
    embedded one lacks (llguidance's own default there is any whitespace)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def _schema_grammar(schema: dict, kind: str = "json_schema") -> Grammar:
    try:
        grammar = Grammar.json_schema(schema)
    except DraftwiseError as err:
        raise RequestError(str(err), "response_format") from err
    return Grammar(grammar.source, kind)  # (the kind names it in errors)


def _checked(grammar: Grammar, param: str, check) -> Grammar:
    try:
        check(grammar)
    except DraftwiseError as err:
        raise RequestError(str(err), param) from err
    return grammar
