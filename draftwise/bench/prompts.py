"""Benchmark prompts: the vendored Spec-Bench set plus a code category, user JSONL files, selection."""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from itertools import zip_longest
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.files import read_prompt_file

# Spec-Bench reports these eight MT-bench categories (10 prompts each) as one "mt_bench" row.
MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
REQUIRED_KEYS = ("question_id", "category", "turns")
LINE_FORMAT = '{"question_id": 1, "category": "qa", "turns": ["first user turn", ...]}'
# An optional "schema" (a JSON schema object): the prompt's output must be JSON valid under it (structured output).


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: its id, its category and the text of its first user turn."""

    question_id: int | str
    category: str
    text: str
    schema: dict | None = None  # the JSON schema its output must match (every method runs under that grammar)


def default_prompts() -> list[BenchPrompt]:
    """The built-in set: Spec-Bench (MT-bench categories merged into mt_bench), then the code category."""
    data = files("draftwise.bench") / "data"
    spec_bench = _parse_jsonl(data.joinpath("spec_bench.jsonl").read_text(encoding="utf-8"), "spec_bench.jsonl")
    code = _parse_jsonl(data.joinpath("code.jsonl").read_text(encoding="utf-8"), "code.jsonl")
    merged = [BenchPrompt(p.question_id, _spec_bench_category(p.category), p.text, p.schema) for p in spec_bench]
    return merged + code


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a user JSONL prompt file; categories are kept exactly as written."""
    return _parse_jsonl(read_prompt_file(Path(path)), str(path))


def categories_of(prompts: list[BenchPrompt]) -> list[str]:
    """The categories of prompts, in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def select_prompts(
    prompts: list[BenchPrompt],
    categories: str | list[str] = "all",
    per_category: int | None = None,
    limit: int | None = None,
) -> list[BenchPrompt]:
    """Keep the chosen categories, the first per_category of each, interleaved round-robin, at most limit."""
    _check_count("per_category", per_category)
    _check_count("limit", limit)
    wanted = _parse_categories(categories, categories_of(prompts))
    groups = [[p for p in prompts if p.category == c][:per_category] for c in wanted]
    # Round-robin (1st of each category, then 2nd, ...) so a small limit still spans every category,
    # and select(limit=n) is always the first n of the unlimited selection.
    interleaved = [p for row in zip_longest(*groups) for p in row if p is not None]
    return interleaved[:limit]


def _spec_bench_category(category: str) -> str:
    """Spec-Bench's reporting category: the eight MT-bench ones become mt_bench."""
    return "mt_bench" if category in MT_BENCH else category


def _parse_jsonl(text: str, name: str) -> list[BenchPrompt]:
    """Parse JSONL prompt lines (blank lines skipped); errors name the file and line."""
    numbered = [(n, _parse_line(line, f"{name}:{n}")) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not numbered:
        raise DraftwiseError(f"{name}: no prompts; the file needs one JSON object per line like {LINE_FORMAT}")
    first: dict[tuple, int] = {}
    for n, prompt in numbered:  # a prompt's runs, its reference output and its journal entry are found by this key
        key = (prompt.category, prompt.question_id)
        if key in first:
            raise DraftwiseError(f"{name}:{n}: category {key[0]!r} and question_id {key[1]!r} repeat line {first[key]}; "
                                 "each prompt needs its own question_id within its category")
        first[key] = n
    return [prompt for _, prompt in numbered]


def _parse_line(line: str, where: str) -> BenchPrompt:
    """One JSONL line -> BenchPrompt, checked field by field."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DraftwiseError(f"{where}: not valid JSON ({err.msg}); each line must be like {LINE_FORMAT}") from None
    if not isinstance(row, dict):
        raise DraftwiseError(f"{where}: expected a JSON object, got {type(row).__name__}; use {LINE_FORMAT}")
    missing = [k for k in REQUIRED_KEYS if k not in row]
    if missing:
        raise DraftwiseError(f"{where}: missing {', '.join(missing)}; each line needs question_id, category and turns")
    qid, category, turns = row["question_id"], row["category"], row["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise DraftwiseError(f"{where}: question_id must be an integer or a string, got {qid!r}")
    if not isinstance(category, str) or not category.strip():
        raise DraftwiseError(f"{where}: category must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise DraftwiseError(f"{where}: turns must be a non-empty list of strings, got {_short(turns)}")
    schema = row.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise DraftwiseError(f"{where}: schema must be a JSON schema object, got {_short(schema)}")
    return BenchPrompt(question_id=qid, category=category, text=turns[0], schema=schema)


def _parse_categories(categories: str | list[str], available: list[str]) -> list[str]:
    """'all', a list or a comma-separated string -> the wanted categories, in file order."""
    names = categories.split(",") if isinstance(categories, str) else list(categories)
    names = [c.strip() for c in names if c.strip()]
    if names == ["all"]:
        return available
    if not names:
        raise DraftwiseError(f"no categories given; use 'all' or some of: {', '.join(available)}")
    unknown = [c for c in dict.fromkeys(names) if c not in available]
    if unknown:
        raise DraftwiseError(f"unknown category {', '.join(unknown)}; available: all, {', '.join(available)}")
    return [c for c in available if c in names]


def _check_count(name: str, value: int | None) -> None:
    """per_category / limit: None (no cap) or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DraftwiseError(f"{name} must be an integer >= 1 (or unset for no cap), got {value!r}")


def _short(value: object, width: int = 60) -> str:
    """repr(value) cut to width, for error messages."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
