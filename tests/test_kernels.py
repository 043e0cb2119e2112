"""Speed paths chosen at load: the linear kernels (timed, cached per machine) and the dtype (auto).

What must hold: a choice is made from measurements, recorded in the stats, cached so the next load
measures nothing, and never changes the greedy output at float32.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import cpu_kernels, tiny_model, tiny_tokenizer

from draftwise.backends import kernels
from draftwise.backends.kernels import (EXACT_KERNELS, PAD_ROWS, OneDNNLinear, PaddedLinear, SplitLinear,
                                       kernel_counts, plan_kernels, with_kernels)
from draftwise.engine import Engine
from draftwise.errors import DraftwiseError
from draftwise.hardware import machine_key, resolve_dtype

PROMPT = "The quick brown fox jumps over the lazy dog. The dog"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A calibration cache of this test's own."""
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    return tmp_path


def _onednn_works() -> bool:
    try:
        OneDNNLinear(torch.nn.Linear(8, 8))(torch.zeros(1, 8))
        return True
    except RuntimeError:
        return False


needs_onednn = pytest.mark.skipif(not _onednn_works(), reason="this torch build has no oneDNN linear")


# -- the choice rule, on hand-made timings (ms at widths 1, 2, 4, 8) -----------------------------------------


def test_a_flat_kernel_beats_dense_that_grows_with_width():
    assert kernels._choose({"dense": [3.0, 9.0, 17.0, 16.0], "onednn": [2.9, 2.5, 6.5, 7.2]}) == "onednn"


def test_dense_stays_when_the_other_is_not_clearly_faster():
    assert kernels._choose({"dense": [1.0, 1.1, 1.2, 1.3], "onednn": [1.0, 1.08, 1.18, 1.27]}) == "dense"


def test_a_kernel_slower_for_one_token_never_wins():
    # Far flatter when wide, but a plain step would pay 3x: dense stays.
    assert kernels._choose({"dense": [1.0, 2.0, 4.0, 8.0], "onednn": [3.0, 2.0, 2.0, 2.0]}) == "dense"


def test_dense_for_one_token_and_onednn_for_more_wins_where_each_is_best_at_its_width():
    # Zen 3 in float32, the MLP's down projection (ms): oneDNN 15% slower for one row, half dense's time wider.
    timings = {"dense": [3.03, 6.37, 7.78, 8.24], "onednn": [3.47, 3.01, 3.58, 4.39], "split": [3.05, 3.0, 3.6, 4.4]}
    assert kernels._choose(timings) == "split"
    del timings["split"]
    assert kernels._choose(timings) == "dense"  # without it, a plain step keeps its speed and verification pays


def test_padding_wins_where_one_row_costs_more_than_four():
    # Zen 4 in bfloat16, the 1.5B's MLP up projection with its weight streamed from memory (ms at 1, 2, 4, 8 rows):
    # oneDNN's narrow paths are slower than its 4-row one, which the padded kernel runs for 1 to 3 rows.
    timings = {"dense": [1.28, 1.14, 1.28, 1.54], "onednn": [0.91, 0.95, 0.79, 1.03], "padded": [0.8, 0.79, 0.79, 1.03]}
    assert kernels._choose(timings) == "padded"


def test_without_dense_the_least_worst_kernel_wins():
    assert kernels._choose({"int8": [2.0, 2.0], "onednn": [1.5, 4.0]}) == "int8"


# -- planning: measured, cached, robust ------------------------------------------------------------------------


@cpu_kernels
def test_a_plan_is_measured_once_then_read_from_the_cache(home, monkeypatch):
    model = tiny_model("llama", seed=0)
    first = plan_kernels(model)
    assert set(first.choices) == {"float32:128x64", "float32:64x64", "float32:64x128", "float32:32x64",
                                  f"float32:{model.lm_head.out_features}x64"}
    assert all(len(row) == len(first.widths) for per_kernel in first.timings.values() for row in per_kernel.values())
    assert (home / "calibration" / f"{machine_key()}.json").is_file()

    def no_timing(*args):
        raise AssertionError("measured again although the cache holds the answer")

    monkeypatch.setattr(kernels, "_measure", no_timing)
    assert plan_kernels(model).choices == first.choices


@cpu_kernels
def test_a_damaged_cache_is_measured_again(home):
    model = tiny_model("llama", seed=0)
    plan_kernels(model)
    path = home / "calibration" / f"{machine_key()}.json"
    path.write_text("{not json")
    again = plan_kernels(model)
    assert set(again.choices.values()) <= set(EXACT_KERNELS)
    json.loads(path.read_text())  # rewritten whole


@cpu_kernels
def test_a_cached_choice_outside_the_kernels_asked_for_is_measured_again(home):
    # A hand-edited (or damaged) entry naming int8 must never put the target on a kernel that changes its values.
    model = tiny_model("llama", seed=0)
    plan_kernels(model)
    path = home / "calibration" / f"{machine_key()}.json"
    entries = json.loads(path.read_text())
    path.write_text(json.dumps({key: {**entry, "kernel": "int8"} for key, entry in entries.items()}))
    assert set(plan_kernels(model).choices.values()) <= set(EXACT_KERNELS)
    path.write_text("[]")  # JSON, but not a cache
    assert set(plan_kernels(model).choices.values()) <= set(EXACT_KERNELS)


def test_no_kernel_that_builds_is_a_clear_error(monkeypatch):
    def refuses(linear):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setitem(kernels._BUILDERS, "onednn", refuses)
    with pytest.raises(DraftwiseError, match="none of the kernels onednn could be built .* add dense"):
        plan_kernels(tiny_model("llama", seed=0), ("onednn",), cache=False)


def test_a_kernel_that_fails_to_build_is_left_out(monkeypatch):
    def refuses(linear):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setitem(kernels._BUILDERS, "onednn", refuses)
    monkeypatch.setitem(kernels._BUILDERS, "padded", refuses)  # oneDNN too, so it refuses alike
    plan = plan_kernels(tiny_model("llama", seed=0), cache=False)
    assert set(plan.choices.values()) == {"dense"}
    assert all(set(per_kernel) == {"dense"} for per_kernel in plan.timings.values())


def test_dense_only_changes_no_linear_and_copies_only_to_group_attention():
    model = tiny_model("llama", seed=0)  # grouped queries: the copy runs them without copies of the cache
    fast = with_kernels(model, plan_kernels(model, kernels=("dense",)))
    assert kernel_counts(fast) == kernel_counts(model) == {"dense": 15}
    assert all(ours is theirs for ours, theirs in zip(fast.parameters(), model.parameters()))
    model.config._attn_implementation = "eager"  # nothing to change at all: no copy
    assert with_kernels(model, plan_kernels(model, kernels=("dense",))) is model


def test_off_the_cpu_every_linear_stays_dense_and_nothing_is_timed(home):
    model = tiny_model("llama", seed=0).to("meta")  # no data: any timing on it would fail
    plan = plan_kernels(model, kernels=("dense", "onednn", "int8"))
    assert set(plan.choices.values()) == {"dense"} and not plan.timings
    assert kernel_counts(with_kernels(model, plan)) == {"dense": 15} and not (home / "calibration").exists()


# -- applying a plan -------------------------------------------------------------------------------------------


@cpu_kernels
@needs_onednn
def test_a_planned_copy_leaves_the_original_alone_and_computes_the_same():
    model = tiny_model("qwen2", seed=0)  # q/k/v with bias
    fast = with_kernels(model, plan_kernels(model, kernels=("onednn",), cache=False))
    assert kernel_counts(model) == {"dense": 15} and kernel_counts(fast) == {"onednn": 15}
    # Only the linears are new: the embeddings are the very same tensor.
    assert fast.model.embed_tokens.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.inference_mode():
        assert torch.allclose(fast(ids).logits, model(ids).logits, atol=1e-4)


@cpu_kernels
@needs_onednn
def test_the_split_kernel_is_dense_for_one_row_and_onednn_for_more():
    linear = tiny_model("qwen2", seed=0).model.layers[0].self_attn.q_proj  # with bias
    split, onednn = SplitLinear(linear), OneDNNLinear(linear)
    assert split.weight.data_ptr() == linear.weight.data_ptr()  # the model's own weight, not a copy
    with torch.inference_mode():
        for shape in [(1, 64), (1, 1, 64), (2, 64), (1, 5, 64)]:
            x = torch.randn(shape)
            assert torch.equal(split(x), linear(x) if x.numel() == 64 else onednn(x))


@cpu_kernels
@needs_onednn
def test_the_padded_kernel_runs_fewer_rows_than_pad_rows_as_that_many(monkeypatch):
    # in = 1536: wide enough that oneDNN's one-row path rounds differently from its 4-row one in float32 (here)
    linear = torch.nn.Linear(1536, 256)
    padded, onednn = PaddedLinear(linear), OneDNNLinear(linear)
    calls = []
    packed_rows = OneDNNLinear._packed_rows
    counted = lambda self, rows: calls.append(len(rows)) or packed_rows(self, rows)  # noqa: E731
    monkeypatch.setattr(OneDNNLinear, "_packed_rows", counted)
    x = torch.randn(PAD_ROWS + 2, 1536)  # [6, in]
    with torch.inference_mode():
        full = onednn(x[:PAD_ROWS])  # [PAD_ROWS, out]: the 4-row call every narrower one now runs as
        for n in range(1, PAD_ROWS + 1):
            calls.clear()
            assert torch.equal(padded(x[None, :n])[0], full[:n])  # a row's values do not depend on its call's width
            assert calls == [PAD_ROWS]
        calls.clear()
        assert torch.equal(padded(x), onednn(x)) and calls == [PAD_ROWS + 2, PAD_ROWS + 2]  # wider: oneDNN as is


@cpu_kernels
@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "split", "padded"])
@pytest.mark.parametrize("method", ["none", "draft", "lookup"])
@pytest.mark.parametrize("k", [1, 4])
def test_fast_kernels_never_change_the_greedy_output_at_float32(method, k, kernel):
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    reference = Engine.from_models(target, tokenizer, method="none", target_kernels=("dense",)).generate(
        PROMPT, max_new_tokens=40, ignore_eos=True)
    # The other kernel everywhere, whatever this machine's timings say.
    draft = tiny_model("llama", seed=1) if method == "draft" else None
    engine = Engine.from_models(target, tokenizer, draft_model=draft, method=method, target_kernels=(kernel,))
    result = engine.generate(PROMPT, max_new_tokens=40, ignore_eos=True, num_draft_tokens=k)
    assert result.stats.speed_paths["target_kernels"] == {kernel: 15}
    assert result.token_ids == reference.token_ids


def test_the_target_may_not_run_on_a_kernel_that_changes_its_values():
    with pytest.raises(DraftwiseError, match="target kernels must be some of dense, onednn, split, padded, invariant .* got int8"):
        Engine.from_models(tiny_model("llama", seed=0), tiny_tokenizer(), method="none", target_kernels=("int8",))


def test_the_draft_may_run_only_on_a_kernel_the_library_has():
    with pytest.raises(DraftwiseError, match="draft kernels must be some of dense, .*int8-dynamic, invariant, invariant-int8, q4; got int4"):
        Engine.from_models(tiny_model("llama", seed=0), tiny_tokenizer(), draft_model=tiny_model("llama", seed=1),
                           draft_kernels=("int4",))
    with pytest.raises(DraftwiseError, match="draft kernel q4 .* give it alone; got q4, int8"):
        Engine.from_models(tiny_model("llama", seed=0), tiny_tokenizer(), draft_model=tiny_model("llama", seed=1),
                           draft_kernels=("q4", "int8"))


@pytest.mark.parametrize("invariant", [True, False])
def test_the_stats_say_which_paths_were_taken(invariant):
    target, tokenizer = tiny_model("llama", seed=0), tiny_tokenizer()
    engine = Engine.from_models(target, tokenizer, draft_model=tiny_model("llama", seed=1), draft_vocab=100,
                                batch_invariant=invariant)
    paths = engine.generate(PROMPT, max_new_tokens=8).stats.to_dict()["speed_paths"]
    assert paths["dtype"] == "float32"
    assert paths["batch_invariant"] is invariant
    assert sum(paths["target_kernels"].values()) == 15
    assert set(paths["target_kernels"]) <= ({kernels.INVARIANT} if invariant else set(EXACT_KERNELS))
    assert sum(paths["draft_kernels"].values()) == 15
    assert set(paths["draft_kernels"]) <= set(kernels.INVARIANT_KERNELS if invariant else kernels.DRAFT_KERNELS)
    assert paths["draft_vocab"] == len(engine.proposer.token_ids) == 100  # the specials are among the first 100


# -- the dtype ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_follows_the_hardware(native, expected, monkeypatch):
    monkeypatch.setattr("draftwise.hardware.native_bf16", lambda device="cpu": native)
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"


def test_an_unknown_dtype_names_the_allowed_ones():
    with pytest.raises(DraftwiseError, match="dtype must be one of auto, float32, bfloat16, got 'float16'"):
        resolve_dtype("float16")


def test_auto_on_this_machine_is_what_the_cpu_computes_natively():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto") == ("bfloat16" if native else "float32")
