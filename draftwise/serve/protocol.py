"""OpenAI request bodies -> (prompt ids, GenerationConfig), with errors that name the parameter at fault."""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from jinja2 import TemplateError

from draftwise.config import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, SEED_RANGE, GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.serve.request_error import RequestError
from draftwise.serve.structured import output_grammar, read_response_format
from draftwise.serve.tools import CLOSE, OPEN, ToolRequest, prompt_messages, read_history_calls, read_tool_request
from draftwise.tokenizers import encode_prompt

MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 1000  # each stop string: matched against the text's end at every token, on the model's thread
# A prompt string longer than this many characters a context position is refused before it is tokenized (the
# tokenizer runs on the server's one intake thread, intake.py): no tokenizer packs that much text into a token.
MAX_CHARS_PER_TOKEN = 64
MAX_MESSAGES = 2048  # as OpenAI's API: counted before any message is read, so a flood of empty ones is cheap to refuse

# OpenAI parameters this server does not implement: refused when set to anything but "off", so that a client never
# silently gets something other than what it asked for. Fields not named here and not read below are ignored.
UNSUPPORTED = {
    "echo": (None, False), "best_of": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}), "suffix": (None, ""),
    "functions": (None, []),
}
SPECULATION_FIELDS = ("method", "num_draft_tokens", "adaptive", "jump_forward", "draft")


@dataclass(frozen=True)
class Parsed:
    prompt_ids: list[int]
    cfg: GenerationConfig
    stream: bool
    include_usage: bool
    arm: str = ""  # the A/B arm that chose its speculation ("" without an experiment)
    tool_calls: bool = False  # the reply may hold tool calls: read them out of its text (tools.py)


def parse(body, engine, model_id: str, chat: bool, speculation: dict | None = None, experiment=None,
          trust_special_tokens: bool = False) -> Parsed:
    """Check an OpenAI completions (chat=False) or chat completions body against what this server can do.
    speculation: the GenerationConfig options (num_draft_tokens, adaptive) of a request that does not set them.
    With an experiment (experiment.py), a request that leaves out `speculation` gets its arm's.
    Control tokens spelled in the prompt or messages are text unless trust_special_tokens (request_text.py)."""
    parsed, check_context = parse_deferring_context(body, engine, model_id, chat, speculation, experiment,
                                                    trust_special_tokens)
    check_context()
    return parsed


def parse_deferring_context(body, engine, model_id: str, chat: bool, speculation: dict | None = None,
                            experiment=None, trust_special_tokens: bool = False) -> tuple[Parsed, Callable[[], None]]:
    """parse() but for its last check, the engine's context check (engine.check_limits, which raises the
    context_length_exceeded error naming the prompt, messages or max_tokens), given back to run where the engine's
    methods run: the server's model loop (intake.py). What this reads of the engine off that loop calls none of the
    engine's or its backends' methods: its tokenizer, to render and encode (no engine method); max_context and
    readable_ids, fixed at load; methods_available, a function of what was loaded; drafts_available, a tuple of the
    names the loop replaces whole as drafts come and go (read whole: the old one or the new; the loop checks the
    name again, check_open); and the grammar compiler's check (engine.grammars: llguidance's view of the tokenizer,
    which locks for itself and touches no model; compiled here, a grammar costs the loop a set lookup, not up to
    a second)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise RequestError("'model' is required", "model")
    if model != model_id:
        raise RequestError(f"the model {model!r} does not exist; this server serves {model_id!r}", "model",
                           status=404, code="model_not_found", reason="unknown_model")
    _number(body, "n", 1, 1, 1, integer=True)
    _refuse_unsupported(body)
    tools = read_tool_request(body, chat)
    response = read_response_format(body.get("response_format"))
    prompt_ids = (_chat_ids(body, engine.tokenizer, engine.max_context, trust_special_tokens, tools) if chat
                  else _prompt_ids(body, engine.tokenizer, engine.max_context, engine.readable_ids,
                                   trust_special_tokens))
    room = engine.max_context - len(prompt_ids)
    # OpenAI's defaults: the rest of the context for chat (none left: one token, which the context check refuses),
    # 16 for completions.
    default_max = max(room, 1) if chat else 16
    # The newer name wins where it is given; a null one leaves the older name in force.
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, limit, default_max, 1, None, integer=True)
    arm, asked = experiment.assign(body) if experiment is not None else ("", body.get("speculation"))
    spec = speculation_options(asked, engine.methods_available, engine.drafts_available)
    jump_forward = spec.pop("jump_forward", True)  # (the grammar's option, not the config's)
    options = dict(
        **(speculation or {}),
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=max(0, _number(body, "top_k", 0, -1, None, integer=True)),  # -1 (vLLM's "off") is 0 here
        seed=_number(body, "seed", None, *SEED_RANGE, integer=True),
        stop=_stops(body.get("stop")),
    )
    options.update(spec)
    frame_tokens = tools is not None and _frame_tokens(engine.tokenizer)
    options["grammar"] = output_grammar(response, tools, frame_tokens, jump_forward, engine.grammars.check)
    stream = _flag(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is None:
        stream_options = {}
    elif not isinstance(stream_options, dict):
        raise RequestError("'stream_options' must be an object {include_usage}", "stream_options")
    elif not stream:
        raise RequestError("'stream_options' is only allowed with stream: true", "stream_options")
    include_usage = _flag(stream_options, "include_usage", param="stream_options.include_usage")
    try:
        cfg = GenerationConfig.from_options(**options)
    except DraftwiseError as err:
        raise RequestError(str(err)) from err

    def check_context() -> None:  # the engine's own context check, the one the scheduler and the engine run again
        try:
            engine.check_limits(len(prompt_ids), cfg)
        except DraftwiseError as err:  # the prompt alone, or the prompt with the tokens asked for
            param = ("messages" if chat else "prompt") if room < 1 else limit
            raise RequestError(str(err), param, code="context_length_exceeded", reason="context_length") from err
    return Parsed(prompt_ids, cfg, stream, include_usage, arm, tools is not None and tools.offered), check_context


def _refuse_unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise RequestError(f"'{name}' is not supported by this server; leave it out (or set it to "
                               f"{json.dumps(off[-1])})", name, code="unsupported_parameter")


def _prompt_ids(body: dict, tokenizer, max_context: int, readable_ids: int, trust_special_tokens: bool) -> list[int]:
    """readable_ids: the ids the target reads (its embedding's rows, at most the tokenizer's tokens)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        _check_length(len(prompt), max_context * MAX_CHARS_PER_TOKEN, "characters", "prompt", max_context)
        return _encoded(lambda: encode_prompt(tokenizer, prompt, False, trust_special_tokens), "prompt")
    if isinstance(prompt, list) and prompt:
        _check_length(len(prompt), max_context, "token ids", "prompt", max_context)  # (before each id is looked at)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < readable_ids for t in prompt):
                raise RequestError(f"token ids in 'prompt' must be in [0, {readable_ids})", "prompt")
            return list(prompt)
    raise RequestError("'prompt' must be a non-empty string, or a non-empty list of token ids (one prompt: n=1)",
                       "prompt")


def _check_length(size: int, most: int, unit: str, param: str, max_context: int) -> None:
    """Refuse, before tokenizing, what cannot fit the context however it tokenizes: more than `most` units."""
    if size > most:
        raise RequestError(f"the {param} has {size} {unit}; the context holds {max_context} tokens (at most "
                           f"{most} {unit})", param, code="context_length_exceeded", reason="context_length")


def _encoded(encode, param: str) -> list[int]:
    """The tokenizer's ids, or a 400 naming the parameter: text it cannot take (a lone surrogate) or no tokens."""
    try:
        return encode()
    except (TypeError, UnicodeError) as err:
        raise RequestError(f"the {param} cannot be tokenized ({type(err).__name__}: {err}); send valid Unicode "
                           "text", param) from err
    except TemplateError as err:  # the model's template refuses the conversation (e.g. roles must alternate)
        raise RequestError(f"the model's chat template refused these messages: {err}", param) from err
    except DraftwiseError as err:  # (an empty prompt)
        raise RequestError(str(err), param) from err


def _chat_ids(body: dict, tokenizer, max_context: int, trust_special_tokens: bool,
              tools: ToolRequest | None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"'messages' has {len(messages)} messages; at most {MAX_MESSAGES} are allowed", "messages")
    plain = [_message(m, i) for i, m in enumerate(messages)]
    offered = [f.definition() for f in tools.functions] if tools is not None and tools.offered else None
    # (the template the tokenizer renders with: some keep a second one for tools, picked when tools are given)
    template = tokenizer.get_chat_template(tools=offered) if getattr(tokenizer, "chat_template", None) else ""
    plain, definitions = prompt_messages(plain, offered, template)
    size = sum(len(m["role"]) + len(m.get("content") or "") + len(json.dumps(m.get("tool_calls", ""))) for m in plain)
    _check_length(size + len(json.dumps(definitions or "")), max_context * MAX_CHARS_PER_TOKEN, "characters",
                  "messages", max_context)
    return _encoded(lambda: encode_prompt(tokenizer, plain, True, trust_special_tokens, definitions), "messages")


def _message(m, i: int) -> dict:
    """One chat message, checked, as Hugging Face's templates read it: {role, content}, and an assistant's
    `tool_calls` (its content may then be null) or a tool result's `tool_call_id`."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
    content = m.get("content")
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    if isinstance(content, list):  # content parts: only text is understood here
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                   for p in content):
            raise RequestError(f"messages[{i}].content: only text parts (a string 'text') are supported", "messages")
        content = "".join(p.get("text", "") for p in content)
    if content is None and calls:
        content = ""  # (what a template writes for an assistant turn that only calls)
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string", "messages")
    message = {"role": m["role"], "content": content}
    if calls:
        message["tool_calls"] = read_history_calls(calls, f"messages[{i}].tool_calls")
    if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
        message["tool_call_id"] = m["tool_call_id"]
    return message


def _frame_tokens(tokenizer) -> bool:
    """Whether <tool_call> and </tool_call> are tokens of their own in this tokenizer (Qwen2.5's)."""
    added = tokenizer.get_added_vocab()
    return OPEN in added and CLOSE in added


def speculation_options(value, methods_available, drafts_available: tuple[str, ...] = ()) -> dict:
    """The extra body field: false or "off" (the target alone), or {method, num_draft_tokens, adaptive,
    jump_forward, draft}, as GenerationConfig options, and jump_forward (the request's grammar's: parse() takes it
    out). draft: a draft version loaded beside the server's own (a rollout's, rollout.py). Also an experiment's arms
    (experiment.py), checked the same way."""
    if value is None or value is True or value == "on":
        return {}
    if value is False or value == "off":
        return {"method": "none"}
    if not isinstance(value, dict):
        raise RequestError("'speculation' must be false, \"off\", or an object {method, num_draft_tokens, adaptive, "
                           "jump_forward, draft}", "speculation")
    unknown = set(value) - set(SPECULATION_FIELDS)
    if unknown:
        raise RequestError(f"unknown 'speculation' fields: {', '.join(sorted(unknown))}; allowed: "
                           f"{', '.join(SPECULATION_FIELDS)}", "speculation")
    out = {}
    if "method" in value:
        if value["method"] not in methods_available:
            raise RequestError(f"speculation method {value['method']!r} is not available on this server; choose "
                               f"one of: {', '.join(methods_available)}", "speculation.method")
        out["method"] = value["method"]
    if "num_draft_tokens" in value:
        out["num_draft_tokens"] = _number(value, "num_draft_tokens", DEFAULT_DRAFT_TOKENS, 1, MAX_DRAFT_TOKENS,
                                          integer=True, param="speculation.num_draft_tokens")
    if "adaptive" in value:
        out["adaptive"] = _flag(value, "adaptive", param="speculation.adaptive")
    if "draft" in value:
        if value["draft"] not in drafts_available:
            raise RequestError(f"speculation draft {value['draft']!r} is not loaded on this server; loaded: "
                               f"{', '.join(map(repr, drafts_available)) or 'none'}", "speculation.draft")
        out["draft"] = value["draft"]
    if "jump_forward" in value:  # a grammar's forced tokens drafted for free (grammar.py): not a config option
        out["jump_forward"] = _flag(value, "jump_forward", param="speculation.jump_forward")
    return out


def _stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise RequestError(f"'stop' must be a non-empty string of at most {MAX_STOP_CHARS} characters, or a list of "
                           f"up to {MAX_STOPS} of them", "stop")
    return tuple(stops)


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}", param or name)
    return value


def _number(body: dict, name: str, default, low, high, integer: bool = False, open_low: bool = False,
            param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    number = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    # (an int is finite, and math.isfinite overflows on one past a float's range)
    if not number or not (isinstance(value, int) or math.isfinite(value)):
        raise RequestError(f"'{name}' must be {kind}, got {value!r}", param or name)
    too_low = low is not None and (value <= low if open_low else value < low)
    if too_low or (high is not None and value > high):
        left = "(" if open_low else "["
        bounds = f"{left}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise RequestError(f"'{name}' must be {kind} in {bounds}, got {value!r}", param or name)
    return value
