"""Text from a prompt or a chat message is read as text: it never becomes the template's control tokens.

A chat template marks turns with control tokens (Qwen's `<|im_start|>`, `<|im_end|>`). Rendered as text and then
tokenized whole, a message holding those strings would get the tokens themselves, and a user could close their own
turn and open a system one. Here, by default:

- a chat's messages go through transformers' `apply_chat_template(..., sanitize_control_tokens=True)`: the control
  tokens that appear in the messages (the tokenizer's special tokens and the added tokens its template writes) are
  encoded as the plain text they spell, and only those the template writes itself are encoded as tokens. A chat
  with no such text encodes exactly as before;
- a role must be one the template knows (below): a template that builds a token from the role, as in
  `'<|' + role + '|>'`, would otherwise take a role of "end" for its end-of-turn token;
- a plain prompt is encoded with its special tokens split into text (`split_special_tokens`). Added tokens that the
  tokenizer does not mark special (Qwen's fill-in-the-middle markers) are kept as tokens in a plain prompt: a raw
  completion is where a client writes them on purpose.

`trust_special_tokens=True` restores the old reading, for callers that write control tokens on purpose into text
they control (the server's `--trust-request-special-tokens`, the CLI's `--trust-prompt-special-tokens`).
"""
from __future__ import annotations

import re

from draftwise.errors import DraftwiseError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
EVERY_TEMPLATE_ROLES = ("user", "assistant")  # what a chat template is for, named in its source or not


def known_roles(template: str) -> tuple[str, ...]:
    """The chat roles a template knows: user and assistant, and each other chat role its source names as a quoted
    string (as in `message.role == "system"`). A template that names none renders whatever role it is given."""
    named = {match[1] for match in re.findall(r"""(['"])(\w+)\1""", template)}
    return tuple(role for role in CHAT_ROLES if role in EVERY_TEMPLATE_ROLES or role in named)


def check_roles(tokenizer, messages: list[dict]) -> None:
    """Refuse a message whose role the tokenizer's chat template does not know, naming the roles it does."""
    allowed = known_roles(tokenizer.get_chat_template())
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in allowed:
            raise DraftwiseError(f"messages[{i}].role {role!r} is not a role of this model's chat template; use one "
                                 f"of: {', '.join(allowed)}")


def encode_chat(tokenizer, messages: list[dict], trust_special_tokens: bool = False,
                tools: list[dict] | None = None) -> list[int]:
    """Chat messages -> ids of the template's text with a generation prompt; see the module's docstring.
    tools: function definitions for a template that renders them (`tools=` of apply_chat_template); their text is
    sanitized as the messages' is."""
    if trust_special_tokens:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    check_roles(tokenizer, messages)
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                            sanitize_control_tokens=True, return_dict=False)
    except ValueError as err:  # e.g. a control token the tokenizer also makes from its plain text: it cannot be text
        raise DraftwiseError(f"the chat messages cannot be encoded with their control-token text kept as text: {err}"
                             ) from err
    return list(ids)


def encode_text(tokenizer, text: str, trust_special_tokens: bool = False) -> list[int]:
    """A plain prompt -> ids, with the tokenizer's own leading tokens (a BOS) as before; see the module's docstring."""
    return tokenizer(text, split_special_tokens=not trust_special_tokens)["input_ids"]
