"""A simulated service's traffic, to measure the closed loop on (SERVICES):
- "code", a code assistant asked about the functions of the third-party packages installed beside draftwise:
  explain a function, write tests for it, add type hints to it, write it from its docstring;
- "docs", a documentation assistant asked about the sections of those packages' READMEs (their published long
  descriptions): summarize one, list its key points, explain it to a newcomer, answer what it is about.

Why these services: a real one's traffic is narrow (one product, one template, one corpus), and that is what a
distilled draft learns fastest. The two differ in how much room they leave: a code answer repeats the code it was
given, so a small draft already agrees with the target on most of it; a summary is the target's own wording.
Why this text: it is on every machine (no download), and corpus.py's rules keep out everything we evaluate on (the
standard library and any copy of it, draftwise and its Spec-Bench data, any text that names HumanEval, MBPP or
Spec-Bench).

The traffic is split by package, never at random: the first packages (in sorted order) make the earlier traffic a
draft is distilled from, the last ones the later traffic it is judged on, so the two share no file. Each part is a
prompt file for `draftwise loadgen --prompts` (category: the request's kind), in the order it is played.
"""
from __future__ import annotations

import ast
import email
import json
import random
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.files import write_whole
from draftwise.train.corpus import EXCLUDED_PACKAGES, EXCLUDED_WORDS, corpus_texts, installed, package_roots

CODE_KINDS = {
    "explain": "Explain what this function does, and when one would call it.\n\n```python\n{source}\n```",
    "tests": "Write pytest tests for this function.\n\n```python\n{source}\n```",
    "type-hints": "Add type hints to this function without changing what it does; answer with the function.\n\n"
                  "```python\n{source}\n```",
    "implement": "Write the Python function `{name}{signature}` that this docstring describes:\n\n{doc}",
}
DOCS_KINDS = {
    "summary": "Summarize this part of the {package} documentation in a short paragraph.\n\n{text}",
    "key-points": "List the key points of this part of the {package} documentation as short bullets.\n\n{text}",
    "newcomer": "Explain this part of the {package} documentation to a developer who has never used {package}.\n\n"
                "{text}",
    "about": "From this part of the {package} documentation: what is \"{title}\" about, and what should a user do "
             "with it?\n\n{text}",
}
MIN_SOURCE_CHARS = 200  # shorter functions leave little to explain or test
MAX_SOURCE_CHARS = 1500  # longer ones make the prompt, not the answer, the cost
MAX_PER_FILE = 3  # more files, not one file's every function
MIN_SECTION_CHARS = 500  # a README's sections are joined up to this: a heading and a line are no document
MAX_SECTION_CHARS = 2000  # cut at a paragraph past this: the prompt, not the answer, would be the cost
MAX_PER_PACKAGE = 5  # sections of one README
PROSE_SHARE = 0.6  # of a section's characters letters or spaces: tables, code and link lists are not prose
# Lines that are markup, not text: badges, images, raw HTML, reST directives and their options.
MARKUP_LINE = re.compile(r"^\s*(\[!\[|!\[|<|\.\. [\w-]+::|:[\w-]+:)")
RST_UNDERLINE = re.compile(r"^([=\-~^*+#`'\"])\1{2,}\s*$")
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


@dataclass(frozen=True)
class Section:
    label: str  # "package-x.y.dist-info/METADATA#title"
    package: str  # the distribution's name, as its README calls it
    title: str
    text: str


def readme_roots(site_packages: Path | None = None) -> list[Path]:
    """Each installed distribution's metadata folder (its README is its long description), sorted; not draftwise's."""
    return [path for path in installed(site_packages)
            if path.name.endswith(".dist-info") and (path / "METADATA").is_file()
            and path.name.split("-", 1)[0].lower() not in EXCLUDED_PACKAGES]


def readme_sections(dist_info: Path) -> Iterator[Section]:
    """The prose sections of one distribution's README, at most MAX_PER_PACKAGE, in order: split at its headings
    (Markdown's or reST's), short ones joined, long ones cut at a paragraph, markup lines dropped."""
    try:
        message = email.message_from_string((dist_info / "METADATA").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return
    package = str(message.get("Name") or dist_info.name.split("-", 1)[0])
    body = message.get_payload() or str(message.get("Description") or "")
    if not isinstance(body, str):
        return
    found = 0
    for title, text in _joined(_headed_parts(body)):
        if found >= MAX_PER_PACKAGE:
            break
        prose = sum(ch.isalpha() or ch == " " for ch in text) / len(text)
        if prose < PROSE_SHARE or any(word in text.lower() for word in EXCLUDED_WORDS):
            continue
        found += 1
        yield Section(f"{dist_info.name}/METADATA#{title}", package, title, text)


def _headed_parts(body: str) -> Iterator[tuple[str, list[str]]]:
    """(heading, its lines) for each part of a README, markup lines left out."""
    title, lines = "Introduction", []
    raw = body.splitlines()
    for i, line in enumerate(raw):
        underlined = i + 1 < len(raw) and line.strip() and RST_UNDERLINE.match(raw[i + 1])
        if line.startswith("#") or underlined:
            yield title, lines
            title, lines = line.strip("# ").strip() or title, []
        elif not RST_UNDERLINE.match(line) and not MARKUP_LINE.match(line):
            lines.append(line.rstrip())
    yield title, lines


def _joined(parts: Iterator[tuple[str, list[str]]]) -> Iterator[tuple[str, str]]:
    """(title, text): parts joined until MIN_SECTION_CHARS, each cut to MAX_SECTION_CHARS at a paragraph."""
    title, text = None, ""
    for part_title, lines in parts:
        part = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
        if not part:
            continue
        title, text = title or part_title, f"{text}\n\n{part}".strip()
        if len(text) >= MIN_SECTION_CHARS:
            yield title, _cut(text)
            title, text = None, ""


def _cut(text: str) -> str:
    if len(text) <= MAX_SECTION_CHARS:
        return text
    end = text.rfind("\n\n", 0, MAX_SECTION_CHARS)
    return text[:end] if end >= MIN_SECTION_CHARS else text[:MAX_SECTION_CHARS]


@dataclass(frozen=True)
class Service:
    kinds: dict[str, str]  # the request templates, filled from an item's fields
    roots: Callable[[], list[Path]]  # what the traffic is split by, in order
    items: Callable[[Path], Iterator]  # one root's Functions or Sections


SERVICES = {"code": Service(CODE_KINDS, package_roots, package_functions),
            "docs": Service(DOCS_KINDS, readme_roots, readme_sections)}


def request_text(template: str, item) -> str:
    return template.format(**asdict(item))


def traffic(requests: int, eval_share: float = EVAL_SHARE, seed: int = 0, roots: list[Path] | None = None,
            service: str = "code") -> dict[str, list[dict]]:
    """{"train": [...], "eval": [...]}: `requests` prompt records in all, split by package (the last eval_share of
    the packages are eval's), each part in playing order. A record: {"question_id", "category" (the kind),
    "turns": [text], "source" (the function's or section's label), "package"}."""
    if service not in SERVICES:
        raise DraftwiseError(f"no simulated service {service!r}; there are: {', '.join(SERVICES)}")
    if not 0 < eval_share < 1:
        raise DraftwiseError(f"the held-out share of packages must be between 0 and 1, got {eval_share}")
    chosen = SERVICES[service]
    roots = chosen.roots() if roots is None else roots
    if len(roots) < 2:
        raise DraftwiseError(f"a split by package needs at least 2 installed packages, found {len(roots)}")
    held_out = max(1, round(eval_share * len(roots)))
    parts = {"train": roots[:-held_out], "eval": roots[-held_out:]}
    rng = random.Random(seed)
    wanted = {"train": requests - round(eval_share * requests), "eval": round(eval_share * requests)}
    out = {}
    for part, part_roots in parts.items():
        records = []
        for item in _round_robin(part_roots, chosen.items):
            if len(records) >= wanted[part]:
                break
            kind = rng.choice(sorted(chosen.kinds))
            records.append({"question_id": f"{part}-{len(records)}", "category": kind,
                            "turns": [request_text(chosen.kinds[kind], item)], "source": item.label,
                            "package": item.label.split("/", 1)[0]})
        out[part] = records
    return out


def _round_robin(roots: list[Path], items: Callable[[Path], Iterator]) -> Iterator:
    """One item of each package in turn, so no one package is the whole traffic."""
    streams = [items(root) for root in roots]
    while streams:
        for stream in list(streams):
            item = next(stream, None)
            if item is None:
                streams.remove(stream)
            else:
                yield item


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
