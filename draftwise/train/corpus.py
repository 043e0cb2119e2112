"""The head's training text: source and documentation of the third-party packages installed beside draftwise.

Why these: they are on every machine that runs draftwise (no download), they mix code with English prose
(docstrings, READMEs, guides), and nothing we evaluate on is among them. Excluded on purpose: the Python
standard library (users benchmark code assistants on it), a package's vendored copy of it too, draftwise itself
(its package data holds the Spec-Bench prompts), and any file whose path or text names HumanEval, MBPP or
Spec-Bench. Files are taken round-robin across packages
in sorted order, so the corpus is the same on every run and no one package dominates it.
"""
from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".py", ".md", ".rst", ".txt")
EXCLUDED_PACKAGES = ("draftwise",)
EXCLUDED_WORDS = ("humaneval", "human_eval", "human-eval", "mbpp", "spec_bench", "spec-bench", "specbench")
# A package may vendor a copy of a standard-library module (setuptools' _distutils, a backport): a file whose long
# lines are mostly the standard library's is that library, wherever it is installed.
STDLIB_SHARE = 0.5
STDLIB_LINE = 24  # characters: shorter lines ("import os", "return None") are every file's
MAX_FILE_BYTES = 200_000  # generated tables and vendored blobs teach nothing
MIN_FILE_BYTES = 400
MAX_SEQUENCES_PER_FILE = 2  # more files, not longer ones: variety teaches more than one file's tail


def installed(site_packages: Path | None = None) -> list[Path]:
    """What the site-packages folder (this environment's, by default) holds, sorted; nothing where there is none."""
    root = site_packages or Path(sysconfig.get_paths()["purelib"])
    return sorted(root.iterdir()) if root.is_dir() else []


def package_roots(site_packages: Path | None = None) -> list[Path]:
    """Each installed top-level package folder, sorted; never the standard library or draftwise."""
    return [path for path in installed(site_packages)
            if path.is_dir() and not path.name.endswith((".dist-info", ".libs", ".data", "__pycache__"))
            and not path.name.startswith(("_", ".")) and path.name not in EXCLUDED_PACKAGES]


def package_files(root: Path) -> list[Path]:
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(names):
            path = Path(folder) / name
            if path.suffix in SUFFIXES and MIN_FILE_BYTES <= path.stat().st_size <= MAX_FILE_BYTES:
                found.append(path)
    # Prose first (guides, READMEs), then code: the target answers in both, and packages hold far more code.
    return sorted(found, key=lambda path: path.suffix == ".py")


def corpus_texts(roots: list[Path], stdlib: frozenset[int] | None = None) -> Iterator[tuple[str, str]]:
    """(a label "package/relative/path", the file's text), round-robin over the packages' files; each text once (a
    vendored copy is the same file), none that names a benchmark or copies the standard library.
    stdlib: the standard library's long lines (stdlib_lines(); read on first use)."""
    queues = [(root, package_files(root)) for root in roots]
    seen: set[int] = set()
    for i in range(max((len(files) for _, files in queues), default=0)):
        for root, files in queues:
            if i >= len(files):
                continue
            try:
                text = files[i].read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            label = f"{root.name}/{files[i].relative_to(root)}"
            if any(word in f"{label}\n{text}".lower() for word in EXCLUDED_WORDS) or hash(text) in seen:
                continue
            if stdlib is None:
                stdlib = stdlib_lines()
            if copies_stdlib(text, stdlib):
                continue
            seen.add(hash(text))
            yield label, text


def _long_lines(text: str) -> set[int]:
    return {hash(line) for line in map(str.strip, text.splitlines()) if len(line) >= STDLIB_LINE}


@functools.lru_cache(maxsize=1)
def stdlib_lines() -> frozenset[int]:
    """The long lines of the standard library's Python source (of the Python running this)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines: set[int] = set()
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__")]
        for name in names:
            if name.endswith(".py"):
                try:
                    lines |= _long_lines((Path(folder) / name).read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError):
                    continue
    return frozenset(lines)


def copies_stdlib(text: str, stdlib: frozenset[int]) -> bool:
    """Whether most of the text's long lines are the standard library's."""
    lines = _long_lines(text)
    return bool(lines) and len(lines & stdlib) >= STDLIB_SHARE * len(lines)


@dataclass(frozen=True)
class Piece:
    """One training sequence: its token ids, the file it comes from, and where the text to learn starts."""

    source: str  # "package/path": the train/validation split keeps a file's pieces (and answers about it) together
    ids: list[int]
    answer_start: int = 0  # the first position of the answer (after a request and its chat template)


def training_sequences(tokenizer, seq_len: int, max_tokens: int, roots: list[Path] | None = None,
                       per_file: int = MAX_SEQUENCES_PER_FILE) -> list[Piece]:
    """Token sequences of seq_len tokens (the last of a file may be shorter, at least a quarter of it), at most
    per_file of them from one file, about max_tokens in all. With a chat template, each file is the assistant's answer to a request for it: the head
    then learns the target's features where they matter, inside an answer."""
    pieces, total = [], 0
    for label, text in corpus_texts(package_roots() if roots is None else roots):
        ids, answer_start = _as_answer(tokenizer, label, text)
        for start in range(0, min(len(ids), per_file * seq_len), seq_len):
            chunk = ids[start : start + seq_len]
            if len(chunk) < seq_len // 4:
                break
            pieces.append(Piece(label, chunk, max(0, answer_start - start)))
            total += len(chunk)
            if total >= max_tokens:
                return pieces
    return pieces


def _as_answer(tokenizer, label: str, text: str) -> tuple[list[int], int]:
    """(the file as the assistant's answer to a request for it, where the answer starts)."""
    if getattr(tokenizer, "chat_template", None):
        request = [{"role": "user", "content": f"Show me the file {label}."}]
        try:
            ids = tokenizer.apply_chat_template([*request, {"role": "assistant", "content": text}], tokenize=True,
                                                return_dict=False)
            asked = tokenizer.apply_chat_template(request, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False)
            return list(ids), len(asked)
        except Exception:  # a template that refuses this shape: the plain text teaches the same
            pass
    return tokenizer(text)["input_ids"], 0
