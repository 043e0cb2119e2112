"""A simulated service's traffic, to measure the closed loop on: a code assistant asked about the functions of the
third-party packages installed beside draftwise.

Why this service: a real one's traffic is narrow (one product, one template, one codebase), and that is what a
distilled draft learns fastest; a code assistant over a library's source is a common such service. Why this text:
it is on every machine (no download), and corpus.py's rules keep out everything we evaluate on (the standard library
and any copy of it, draftwise and its Spec-Bench data, any file that names HumanEval, MBPP or Spec-Bench).

The requests (KINDS): explain a function, write tests for it, add type hints to it, write it from its docstring.
The traffic is split by package, never at random: the first packages (in sorted order) make the earlier traffic a
draft is distilled from, the last ones the later traffic it is judged on, so the two share no file. Each part is a
prompt file for `draftwise loadgen --prompts` (category: the request's kind), in the order it is played.
"""
from __future__ import annotations

import ast
import json
import random
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.files import write_whole
from draftwise.train.corpus import corpus_texts, package_roots

KINDS = {
    "explain": "Explain what this function does, and when one would call it.\n\n```python\n{source}\n```",
    "tests": "Write pytest tests for this function.\n\n```python\n{source}\n```",
    "type-hints": "Add type hints to this function without changing what it does; answer with the function.\n\n"
                  "```python\n{source}\n```",
    "implement": "Write the Python function `{name}{signature}` that this docstring describes:\n\n{doc}",
}
MIN_SOURCE_CHARS = 200  # shorter functions leave little to explain or test
MAX_SOURCE_CHARS = 1500  # longer ones make the prompt, not the answer, the cost
MAX_PER_FILE = 3  # more files, not one file's every function
EVAL_SHARE = 0.25  # of the packages (the last ones) that make the later, held-out traffic


@dataclass(frozen=True)
class Function:
    label: str  # "package/relative/path.py:name"
    name: str
    signature: str  # "(a, b=1)"
    doc: str
    source: str


def package_functions(root: Path) -> Iterator[Function]:
    """The documented functions of one package's Python files (corpus.py's files: no standard library, no
    benchmark), at most MAX_PER_FILE a file, in file order."""
    for label, text in corpus_texts([root]):
        if not label.endswith(".py"):
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        found = 0
        for node in ast.walk(tree):
            if found >= MAX_PER_FILE:
                break
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            doc, source = ast.get_docstring(node), ast.get_source_segment(text, node, padded=True)
            source = textwrap.dedent(source) if source else source  # a method as it would stand alone
            if not doc or not source or not MIN_SOURCE_CHARS <= len(source) <= MAX_SOURCE_CHARS:
                continue
            found += 1
            yield Function(f"{label}:{node.name}", node.name, f"({ast.unparse(node.args)})", doc, source)


def request_text(kind: str, function: Function) -> str:
    return KINDS[kind].format(source=function.source, name=function.name, signature=function.signature,
                              doc=function.doc)


def traffic(requests: int, eval_share: float = EVAL_SHARE, seed: int = 0,
            roots: list[Path] | None = None) -> dict[str, list[dict]]:
    """{"train": [...], "eval": [...]}: `requests` prompt records in all, split by package (the last eval_share of
    the packages are eval's), each part in playing order. A record: {"question_id", "category" (the kind),
    "turns": [text], "source" (the function's label), "package"}."""
    if not 0 < eval_share < 1:
        raise DraftwiseError(f"the held-out share of packages must be between 0 and 1, got {eval_share}")
    roots = package_roots() if roots is None else roots
    if len(roots) < 2:
        raise DraftwiseError(f"a split by package needs at least 2 installed packages, found {len(roots)}")
    held_out = max(1, round(eval_share * len(roots)))
    parts = {"train": roots[:-held_out], "eval": roots[-held_out:]}
    rng = random.Random(seed)
    wanted = {"train": requests - round(eval_share * requests), "eval": round(eval_share * requests)}
    out = {}
    for part, part_roots in parts.items():
        records = []
        for function in _round_robin(part_roots):
            if len(records) >= wanted[part]:
                break
            kind = rng.choice(sorted(KINDS))
            records.append({"question_id": f"{part}-{len(records)}", "category": kind,
                            "turns": [request_text(kind, function)], "source": function.label,
                            "package": function.label.split("/", 1)[0]})
        out[part] = records
    return out


def _round_robin(roots: list[Path]) -> Iterator[Function]:
    """One function of each package in turn, so no one package is the whole traffic."""
    streams = [package_functions(root) for root in roots]
    while streams:
        for stream in list(streams):
            function = next(stream, None)
            if function is None:
                streams.remove(stream)
            else:
                yield function


def write_traffic(out: Path, parts: dict[str, list[dict]]) -> dict[str, Path]:
    """OUT/train.jsonl and OUT/eval.jsonl, each written whole."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for part, records in parts.items():
        def write(partial: Path, records=records) -> None:
            partial.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        paths[part] = out / f"{part}.jsonl"
        write_whole(paths[part], write)
    return paths
