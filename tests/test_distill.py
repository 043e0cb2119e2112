"""The closed loop's learning half: a draft distilled from a proposal log's traffic, split by time, kept as a checked
version in the store, loaded by name; and the simulated traffic, split by package."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from conftest import tiny_model, tiny_tokenizer
from draftwise.cli import main
from draftwise.errors import DraftwiseError, ModelStoreError
from draftwise.models.store import resolve
from draftwise.models.versions import apply_version, check_files, split_version, version_folder, versions
from draftwise.serve.proposal_log import ProposalLog
from draftwise.train.distill import Recipe, agreement, chain_rounds, distill
from draftwise.train.served import served_requests, time_split, window
from draftwise.train.traffic import traffic

PHRASE = " the fox runs away. The dog sleeps; the fox runs away."
OTHER = " for i in range(10):\n    print(i * i)\nreturn sorted(values)"
FAST = Recipe(rank=8, alpha=16.0, lr=2e-2, epochs=4, seq_len=64, held_out=0.25, warmup_steps=2)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    return tmp_path


def write_log(path: Path, outputs: list[str], finish: str = "length") -> None:
    """One finished request per output, in order (each after a different prompt), as the server records them."""
    tok = tiny_tokenizer()
    log = ProposalLog(path)
    for i, output in enumerate(outputs):
        prompt = tok(f"Request {i}: tell me about item {i * 7 % 13}.")["input_ids"]
        log.record_request(f"{path.stem}-{i:03d}", "default", "draft", prompt, tok(output)["input_ids"], finish)
        time.sleep(0.002)  # distinct times: the split is by time
    log.close()


def draft_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "tiny-draft"
    tiny_model("llama", 1, 1).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_the_split_is_by_time_and_too_little_traffic_is_refused(tmp_path):
    write_log(tmp_path / "a.db", [PHRASE] * 6)
    write_log(tmp_path / "b.db", [OTHER] * 6)  # written after a.db: its requests are the latest
    served = served_requests([tmp_path / "a.db", tmp_path / "b.db"])
    assert [s.ts for s in served] == sorted(s.ts for s in served)
    train, held_out = time_split(served, 0.25)
    assert len(held_out) == 3 and min(s.ts for s in held_out) > max(s.ts for s in train)
    assert all(tiny_tokenizer().decode(s.ids[s.answer_start:]) == OTHER for s in held_out)
    with pytest.raises(DraftwiseError, match="holds 6 finished requests.*at least 10"):
        time_split(served_requests([tmp_path / "a.db"]), 0.25)


def test_requests_that_failed_or_were_blocked_are_not_learnt_from(tmp_path):
    write_log(tmp_path / "ok.db", [PHRASE] * 3)
    write_log(tmp_path / "bad.db", [PHRASE] * 2, finish="error")
    write_log(tmp_path / "blocked.db", [PHRASE] * 2, finish="content_filter")
    assert len(served_requests([tmp_path / "ok.db", tmp_path / "bad.db", tmp_path / "blocked.db"])) == 3


def test_a_long_request_keeps_its_output_in_the_window():
    from draftwise.train.served import Served

    item = Served("r", 0.0, list(range(100)), 90)
    ids, start = window(item, 32)
    assert ids == list(range(68, 100)) and start == 22
    item = Served("r", 0.0, list(range(100)), 20)  # an output longer than the window: its start, after context
    ids, start = window(item, 32)
    assert ids[start] == 20 and start == 8 and len(ids) == 32
    item = Served("r", 0.0, list(range(40)), 8)  # an output of exactly the window: its first token is still read
    ids, start = window(item, 32)
    assert start >= 1 and ids[start] == 8


def test_distilling_raises_held_out_agreement_on_traffic_like_the_training(home):
    write_log(home / "log.db", [PHRASE] * 16)
    draft = tiny_model("llama", 1, 1)
    model, outcome = distill(draft, "tiny", [str(home / "log.db")], FAST, home / "work", progress=False)
    assert outcome.agreement_before < 0.2 and outcome.agreement_after > 0.8, outcome
    assert outcome.held_out["requests"] == 4 and outcome.trained_on["requests"] == 12
    assert outcome.held_out["first_ts"] > outcome.trained_on["last_ts"]


def test_the_agreement_is_measured_on_the_held_out_traffic_not_the_training(home):
    """The control: the earlier traffic teaches one text, the later asks for another; the draft learns the first
    (its agreement there rises), and the held-out figure, on the second, must not rise with it."""
    write_log(home / "log.db", [PHRASE] * 12 + [OTHER] * 4)
    model, outcome = distill(tiny_model("llama", 1, 1), "tiny", [str(home / "log.db")], FAST, home / "work",
                             progress=False)
    train, _ = time_split(served_requests([home / "log.db"]), FAST.held_out)
    assert agreement(model, train, FAST.seq_len).share > 0.8
    assert outcome.agreement_after < 0.5, outcome


def test_a_version_is_saved_whole_checked_and_loaded_by_name(home, capsys):
    folder = draft_folder(home)
    write_log(home / "log.db", [PHRASE] * 16)
    args = ["distill", str(home / "log.db"), "--draft", str(folder), "--target", str(folder), "--epochs", "4",
            "--rank", "8", "--lr", "0.02", "--seq-len", "64", "--held-out", "0.25", "-q", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["version"] == f"{folder}@v1" and record["agreement_after"] > record["agreement_before"]
    assert versions("tiny-draft") == [1] and not list((home / "home" / "tmp").iterdir())  # no work left behind
    made = version_folder("tiny-draft", 1)
    manifest = check_files(made)
    assert manifest["held_out"]["requests"] == 4 and manifest["from"] == str(folder)
    assert set(manifest["files"]) >= {"adapter_config.json", "adapter_model.safetensors"}

    # Loaded by name: the base's weights with the adapter merged, the same logits as the adapter beside them.
    source = resolve(f"{folder}@v1")
    assert source.path == folder.resolve() and source.adapter == made
    ids = torch.tensor([tiny_tokenizer()("Request 3: tell me")["input_ids"]])
    merged = apply_version(tiny_model("llama", 1, 1), made)
    beside = PeftModel.from_pretrained(tiny_model("llama", 1, 1), str(made))
    assert torch.allclose(merged(ids).logits, beside(ids).logits, atol=1e-5)
    assert not torch.allclose(merged(ids).logits, tiny_model("llama", 1, 1)(ids).logits, atol=1e-3)

    # A second run makes the next version; one distilled from a version loads on top of it; a changed file is
    # refused at load.
    assert main(args) == 0
    assert versions("tiny-draft") == [1, 2]
    on_v1 = [*args[:3], f"{folder}@v1", *args[4:]]
    assert main(on_v1) == 0 and versions("tiny-draft") == [1, 2, 3]
    v3 = version_folder("tiny-draft", 3)
    assert check_files(v3)["from"] == f"{folder}@v1"
    stacked = PeftModel.from_pretrained(apply_version(tiny_model("llama", 1, 1), made), str(v3))
    alone = PeftModel.from_pretrained(tiny_model("llama", 1, 1), str(v3))
    loaded = apply_version(tiny_model("llama", 1, 1), v3)
    assert torch.allclose(loaded(ids).logits, stacked(ids).logits, atol=1e-5)
    assert not torch.allclose(loaded(ids).logits, alone(ids).logits, atol=1e-3)  # the control: v1 really counts
    (made / "adapter_model.safetensors").write_bytes(b"damaged")
    with pytest.raises(ModelStoreError, match="changed since it was made"):
        apply_version(tiny_model("llama", 1, 1), made)


def test_a_missing_version_names_the_ones_there(home):
    assert split_version("qwen@v3") == ("qwen", 3) and split_version("qwen") == ("qwen", None)
    assert split_version("./a@b/model") == ("./a@b/model", None)
    with pytest.raises(ModelStoreError, match="no draft version qwen@v3.*none yet"):
        resolve("qwen@v3")


def test_distill_refuses_a_log_with_too_little_traffic_before_loading_a_model(home, capsys):
    write_log(home / "log.db", [PHRASE] * 4)
    assert main(["distill", str(home / "log.db"), "--draft", "no-such-model", "-q"]) != 0
    assert "distilling needs at least" in capsys.readouterr().err


def test_the_simulated_traffic_is_split_by_package(tmp_path):
    for name in ("alpha", "beta", "gamma", "delta"):
        package = tmp_path / name
        package.mkdir()
        functions = "\n\n".join(
            f"def {name}_{i}(values, scale=2):\n    \"\"\"Scale each value of {name} and keep the positive ones.\"\"\"\n"
            + "".join(f"    step{j} = [v * scale + {j} for v in values if v > {j}]\n" for j in range(4))
            + "    return step0 + step1\n" for i in range(5))
        (package / "module.py").write_text(functions)
    parts = traffic(12, eval_share=0.25, roots=sorted(tmp_path.iterdir()))
    assert len(parts["train"]) == 9 and len(parts["eval"]) == 3
    train_packages = {r["package"] for r in parts["train"]}
    assert {r["package"] for r in parts["eval"]} == {"gamma"} and "gamma" not in train_packages
    assert len(train_packages) == 3  # round-robin: no one package is the whole traffic
    assert all("```python" in r["turns"][0] or "docstring" in r["turns"][0] for r in parts["train"])


def _readme(package: str, body: str) -> str:
    return f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n\n{body}"


def test_the_docs_service_asks_about_readme_sections_split_by_package(tmp_path):
    paragraph = "This part explains how the {0} client retries a request that failed, and why it waits longer " \
                "each time before it tries again. "
    for name in ("alpha", "beta", "gamma", "delta"):
        info = tmp_path / f"{name}-1.0.dist-info"
        info.mkdir()
        markdown = "\n\n".join(f"## Part {i}\n\n[![badge](https://x/b.svg)](https://x)\n<p align=center>\n\n"
                               + paragraph.format(name) * 6 for i in range(3))
        (info / "METADATA").write_text(_readme(name, "# Title\n\n" + markdown))
    rst = tmp_path / "epsilon-1.0.dist-info"  # reST headings: a line underlined
    rst.mkdir()
    (rst / "METADATA").write_text(_readme("epsilon", "Usage\n=====\n\n.. image:: https://x/b.svg\n   :alt: b\n\n"
                                           + paragraph.format("epsilon") * 6 + "\n\nMore\n----\n\nshort"))
    benchmark = tmp_path / "zeta-1.0.dist-info"  # a README that names a benchmark is never traffic
    benchmark.mkdir()
    (benchmark / "METADATA").write_text(_readme("zeta", "## Scores\n\n" + "Our HumanEval score is high. " * 30))

    parts = traffic(12, eval_share=0.25, roots=sorted(tmp_path.iterdir()), service="docs")
    train_packages = {r["package"] for r in parts["train"]}
    assert len(parts["train"]) == 9 and len(parts["eval"]) == 3
    # the last two packages are eval's, and zeta's only section named a benchmark
    assert {r["package"] for r in parts["eval"]} == {"gamma-1.0.dist-info"}
    assert train_packages == {f"{name}-1.0.dist-info" for name in ("alpha", "beta", "delta", "epsilon")}
    texts = [r["turns"][0] for r in parts["train"] + parts["eval"]]
    assert not any("badge" in t or "<p" in t or ".. image" in t or ":alt:" in t or "HumanEval" in t for t in texts)
    assert any("epsilon documentation" in t and "Usage" not in t.split("\n\n", 1)[1] for t in texts)
    assert {r["category"] for r in parts["train"]} <= {"summary", "key-points", "newcomer", "about"}
    with pytest.raises(DraftwiseError, match="no simulated service 'chat'"):
        traffic(12, roots=sorted(tmp_path.iterdir()), service="chat")


def test_guesses_kept_in_rounds_follow_from_the_teacher_forced_matches():
    assert chain_rounds([True] * 10, 4) == (8, 8)  # rounds at 0 and 5 keep 4 each; the target adds 4 and 9
    assert chain_rounds([True, False, True, True, True], 2) == (3, 4)  # 1 of 2 (and the target's), then 2 of 2
    assert chain_rounds([False] * 3, 4) == (0, 3)  # 2 offered, then 1, then none for the last token
    assert chain_rounds([], 4) == (0, 0)


def test_guesses_kept_match_what_the_engine_keeps_drafting_with_that_draft():
    """chain_rounds claims exactness: the engine's own count, greedy with a fixed k of the same draft, must equal it
    (a draft near the target's weights, so that some guesses are kept and some not)."""
    from draftwise.config import GenerationConfig
    from draftwise.engine import Engine

    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    draft = tiny_model("llama", seed=0)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(0.003 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)))
    prompt = tokenizer.encode("the quick brown fox")
    engine = Engine.from_models(target, tokenizer, draft_model=draft, method="draft")
    for length in (37, 41):  # (answers whose last round starts at their last token, where no draft is offered)
        result = engine.generate(prompt, max_new_tokens=length, ignore_eos=True, adaptive=False, num_draft_tokens=4)
        answer = result.token_ids
        logits = draft(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1: -1]  # [A, V]
        matches = (logits.argmax(-1) == torch.tensor(answer)).tolist()
        assert 0 < sum(matches) < len(matches)
        assert chain_rounds(matches, 4) == (result.stats.accepted, result.stats.proposed)
