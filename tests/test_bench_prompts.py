"""Benchmark prompt sets: the vendored default set, user JSONL files and their errors, selection."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftwise.bench.prompts import BenchPrompt, categories_of, default_prompts, load_prompts, select_prompts
from draftwise.errors import DraftwiseError

DEFAULT_CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "code"]


def _write(tmp_path: Path, lines: list[str], name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _row(qid: int | str, category: str, *turns: str) -> str:
    return json.dumps({"question_id": qid, "category": category, "turns": list(turns)})


def _prompts(spec: dict[str, int]) -> list[BenchPrompt]:
    """Prompts grouped by category in dict order; ids like 'a1', 'a2', 'b1'."""
    return [BenchPrompt(f"{c}{i}", c, f"text {c}{i}") for c, n in spec.items() for i in range(1, n + 1)]


def _ids(prompts: list[BenchPrompt]) -> list[int | str]:
    return [p.question_id for p in prompts]


# --- the default set ---


def test_default_set_sizes_and_category_order():
    prompts = default_prompts()
    assert len(prompts) == 480 + 8
    assert categories_of(prompts) == DEFAULT_CATEGORIES
    counts = {c: sum(p.category == c for p in prompts) for c in DEFAULT_CATEGORIES}
    assert counts == {c: 80 for c in DEFAULT_CATEGORIES[:-1]} | {"code": 8}


def test_default_set_merges_mt_bench_and_keeps_first_turn():
    prompts = default_prompts()
    first = prompts[0]
    assert (first.question_id, first.category) == (81, "mt_bench")
    # Only the first of the two MT-bench turns, not the "Rewrite your previous response" follow-up.
    assert first.text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert "Rewrite your previous response" not in first.text
    assert not {"writing", "coding", "humanities"} & set(categories_of(prompts))


def test_default_code_category():
    code = [p for p in default_prompts() if p.category == "code"]
    assert _ids(code) == list(range(10001, 10009))
    assert sum(p.text.startswith("Complete this Python function:") for p in code) == 4
    assert all("```" in p.text for p in code)


# --- user files ---


def test_user_file_keeps_its_categories_and_first_turn(tmp_path):
    path = _write(tmp_path, [_row(1, "writing", "one", "two"), "", "   ", _row("x", "mine", "three")])
    prompts = load_prompts(path)
    assert prompts == [BenchPrompt(1, "writing", "one"), BenchPrompt("x", "mine", "three")]
    assert categories_of(prompts) == ["writing", "mine"]


def test_missing_file(tmp_path):
    with pytest.raises(DraftwiseError, match="prompt file not found: .*nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")


def test_not_json_names_the_line(tmp_path):
    path = _write(tmp_path, [_row(1, "a", "x"), "", "{not json"])
    with pytest.raises(DraftwiseError, match=r"p\.jsonl:3: not valid JSON .*question_id"):
        load_prompts(path)


def test_non_object_line(tmp_path):
    path = _write(tmp_path, ['["a", "b"]'])
    with pytest.raises(DraftwiseError, match=r"p\.jsonl:1: expected a JSON object, got list"):
        load_prompts(path)


@pytest.mark.parametrize("key", ["question_id", "category", "turns"])
def test_missing_key_names_it_and_the_line(tmp_path, key):
    row = {"question_id": 2, "category": "a", "turns": ["x"]}
    del row[key]
    path = _write(tmp_path, [_row(1, "a", "x"), json.dumps(row)])
    with pytest.raises(DraftwiseError, match=rf"p\.jsonl:2: missing {key}; each line needs question_id, category"):
        load_prompts(path)


@pytest.mark.parametrize("turns", [[], "just a string", ["ok", 3], None])
def test_bad_turns(tmp_path, turns):
    path = _write(tmp_path, [json.dumps({"question_id": 1, "category": "a", "turns": turns})])
    with pytest.raises(DraftwiseError, match=r"p\.jsonl:1: turns must be a non-empty list of strings"):
        load_prompts(path)


def test_bad_category_and_id(tmp_path):
    path = _write(tmp_path, [json.dumps({"question_id": 1, "category": "", "turns": ["x"]})])
    with pytest.raises(DraftwiseError, match=r"p\.jsonl:1: category must be a non-empty string"):
        load_prompts(path)
    path = _write(tmp_path, [json.dumps({"question_id": [1], "category": "a", "turns": ["x"]})])
    with pytest.raises(DraftwiseError, match=r"p\.jsonl:1: question_id must be an integer or a string"):
        load_prompts(path)


def test_a_repeated_prompt_id_names_both_lines(tmp_path):
    # Runs, reference outputs and the journal find a prompt by (category, question_id): two would be confused.
    rows = [{"question_id": 1, "category": "a", "turns": ["x"]}, {"question_id": 1, "category": "b", "turns": ["y"]},
            {"question_id": 1, "category": "a", "turns": ["z"]}]
    path = _write(tmp_path, [json.dumps(row) for row in rows])
    with pytest.raises(DraftwiseError, match=r"p\.jsonl:3: category 'a' and question_id 1 repeat line 1"):
        load_prompts(path)


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DraftwiseError, match=r"empty\.jsonl: no prompts"):
        load_prompts(path)


# --- selection ---


def test_select_all_is_round_robin():
    prompts = _prompts({"a": 3, "b": 1, "c": 2})
    assert _ids(select_prompts(prompts)) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_select_per_category_takes_first_n_in_file_order():
    prompts = _prompts({"a": 3, "b": 1, "c": 2})
    assert _ids(select_prompts(prompts, per_category=2)) == ["a1", "b1", "c1", "a2", "c2"]


def test_select_limit_spans_categories():
    prompts = _prompts({"a": 3, "b": 1, "c": 2})
    assert _ids(select_prompts(prompts, limit=4)) == ["a1", "b1", "c1", "a2"]
    assert _ids(select_prompts(prompts, per_category=1, limit=2)) == ["a1", "b1"]
    assert _ids(select_prompts(prompts, limit=100)) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_select_limit_on_default_set_covers_all_categories():
    chosen = select_prompts(default_prompts(), limit=7)
    assert [p.category for p in chosen] == DEFAULT_CATEGORIES
    assert _ids(chosen) == [81, 161, 241, 321, 401, 481, 10001]


def test_select_categories_list_or_comma_string_in_file_order():
    prompts = _prompts({"a": 2, "b": 1, "c": 2})
    assert _ids(select_prompts(prompts, "c, a")) == ["a1", "c1", "a2", "c2"]
    assert _ids(select_prompts(prompts, ["c"])) == ["c1", "c2"]
    assert _ids(select_prompts(prompts, "all", per_category=1)) == ["a1", "b1", "c1"]


def test_select_unknown_category_lists_available():
    prompts = _prompts({"a": 1, "b": 1})
    with pytest.raises(DraftwiseError) as info:
        select_prompts(prompts, "a,zzz")
    assert str(info.value) == "unknown category zzz; available: all, a, b"


@pytest.mark.parametrize("kwargs", [{"per_category": 0}, {"limit": 0}, {"limit": -3}])
def test_select_counts_must_be_positive(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(DraftwiseError, match=rf"{name} must be an integer >= 1"):
        select_prompts(_prompts({"a": 1}), **kwargs)


def test_select_no_categories_given():
    with pytest.raises(DraftwiseError, match="no categories given; use 'all' or some of: a"):
        select_prompts(_prompts({"a": 1}), " , ")


def test_a_prompt_may_carry_a_json_schema(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    line = json.dumps({"question_id": 1, "category": "json", "turns": ["give a"], "schema": schema})
    assert load_prompts(_write(tmp_path, [line, _row(2, "json", "plain")])) == [
        BenchPrompt(1, "json", "give a", schema), BenchPrompt(2, "json", "plain")]
    bad = json.dumps({"question_id": 1, "category": "json", "turns": ["x"], "schema": "not an object"})
    with pytest.raises(DraftwiseError, match=r"p.jsonl:1: schema must be a JSON schema object"):
        load_prompts(_write(tmp_path, [bad]))
