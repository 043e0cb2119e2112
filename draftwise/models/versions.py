"""Draft versions: what `draftwise distill` made, kept beside the base draft, named "<base draft>@v<N>".

Layout: $DRAFTWISE_HOME/drafts/<base draft>/v<N>/ holds a low-rank adapter (peft's adapter_config.json and
adapter_model.safetensors) and draftwise.json: its provenance (the base draft, the logs and the span of requests
it learnt from, the recipe, its held-out agreement, the time it took) and every file's SHA-256, checked at load.
A version is written in a work folder and renamed into place whole, under the next free number: a folder under
drafts/ is complete or absent.

A version loads as its base draft, from the base's own files, with the adapter merged into the float weights
(apply_version): every backend that reads the draft as floats (hf, and quant, which packs it into 4 bits after)
runs it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from draftwise.errors import ModelStoreError
from draftwise.extras import need
from draftwise.models.home import store_home

MANIFEST = "draftwise.json"
SEPARATOR = "@"


def split_version(name: str) -> tuple[str, int | None]:
    """"base@v3" -> ("base", 3); anything else (a name, a path) -> (name, None)."""
    match = re.fullmatch(rf"(.+){SEPARATOR}v(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, None)


def drafts_home(base: str) -> Path:
    return store_home() / "drafts" / Path(os.path.abspath(base)).name.removesuffix(".gguf")


def versions(base: str, complete: bool = True) -> list[int]:
    """The version numbers of base, oldest first (complete=False: also folders without a manifest, whose numbers a
    new version must not take)."""
    home = drafts_home(base)
    found = [int(p.name[1:]) for p in home.glob("v*")
             if re.fullmatch(r"v\d+", p.name) and (not complete or (p / MANIFEST).is_file())]
    return sorted(found)


def version_folder(base: str, version: int) -> Path:
    folder = drafts_home(base) / f"v{version}"
    if not (folder / MANIFEST).is_file():
        have = ", ".join(f"{base}{SEPARATOR}v{v}" for v in versions(base)) or "none yet (`draftwise distill` makes them)"
        raise ModelStoreError(f"no draft version {base}{SEPARATOR}v{version}; versions of {base}: {have}")
    return folder


def manifest(folder: Path) -> dict:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise ModelStoreError(f"draft version {folder} has no readable {MANIFEST}: {err}") from None


def save_version(base: str, write, provenance: dict) -> tuple[str, Path]:
    """write(folder) puts the adapter's files in a work folder; they are checksummed, the manifest is added, and the
    folder is renamed into place as the next version. -> (its name, its folder)."""
    (store_home() / "tmp").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"distill-{drafts_home(base).name}-", dir=store_home() / "tmp"))
    try:
        write(work)
        files = {p.name: _sha256(p) for p in sorted(work.iterdir()) if p.is_file()}
        record = {"base": base, **provenance, "files": files,
                  "made_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        home = drafts_home(base)
        home.mkdir(parents=True, exist_ok=True)
        while True:  # the next free number; another distill may take it first
            version = max(versions(base, complete=False), default=0) + 1
            record["version"] = f"{base}{SEPARATOR}v{version}"
            (work / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
            try:
                os.rename(work, home / f"v{version}")  # fails if the folder exists: never replaces a version
                return record["version"], home / f"v{version}"
            except OSError:
                if not (home / f"v{version}").exists():
                    raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_files(folder: Path) -> dict:
    """The version's manifest, once every file it names has the SHA-256 it recorded."""
    record = manifest(folder)
    for name, digest in record.get("files", {}).items():
        path = folder / name
        if not path.is_file() or _sha256(path) != digest:
            raise ModelStoreError(f"draft version {folder}: {name} is missing or changed since it was made "
                                  f"(its SHA-256 differs); distill it again")
    return record


def apply_version(model, folder: Path):
    """model (the base draft, floats) with the version's adapter merged into its weights: after those of the versions
    it was distilled from (a version distilled from base@v1 learnt on top of v1's weights)."""
    need("train", what=f"the distilled draft version {folder}")  # (peft merges its adapter)
    from peft import PeftModel

    record = check_files(folder)
    parent_base, parent = split_version(str(record.get("from", "")))
    if parent is not None:
        model = apply_version(model, version_folder(parent_base, parent))
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    if hasattr(merged, "peft_config"):  # (left behind by the merge: a plain model again, for a version on top of it)
        del merged.peft_config
    return merged


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
