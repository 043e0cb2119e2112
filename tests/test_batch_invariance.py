"""Batch invariance: a position's logits are the same bits whatever call computed them, so every method, every
batch, every k and a prompt-cache hit give none's tokens, in bfloat16 as in float32 (kernels.InvariantLinear,
attention.row_invariant_attention). Controls: with batch_invariant=False the same comparisons find differences."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import ARCHS, cpu_kernels, decode_together, onednn_packs, tiny_model, tiny_tokenizer

from draftwise import Engine
from draftwise.backends.kernels import PAD_ROWS, TILE_ROWS, InvariantLinear, NoInvariantKernel
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.types import TreeLayout

pytestmark = cpu_kernels
DTYPES = [torch.bfloat16, torch.float32]
TEXT = [(i * 37 + 11) % 290 + 3 for i in range(100)]  # token ids of the tiny vocabulary, no pattern a model knows
PROMPTS = ["def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
           "The quick brown fox jumps over the lazy dog. The dog",
           "Summaries copy spans of the article: the article says"]
NEW_TOKENS = 24


# -- the linear kernel ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(96, 64), (200, 136), (1536, 1536)])
@pytest.mark.parametrize("runs", [("dense", "onednn"), ("dense",), ("onednn",), ("int8",)], ids="+".join)
def test_a_rows_result_is_the_same_bits_in_calls_of_any_width(dtype, shape, runs):
    torch.manual_seed(0)
    linear = torch.nn.Linear(shape[1], shape[0], bias=True).to(dtype)
    refused = (runs == ("int8",) and shape[1] % 16  # torch's int8 kernel takes widths of 16s only
               or runs == ("onednn",) and not onednn_packs(dtype))  # oneDNN's bfloat16 wants AVX-512 (or AVX-NE)
    if refused:
        with pytest.raises(NoInvariantKernel):  # refused with the way out, no crash
            InvariantLinear(linear, cache=False, runs=runs)
        return
    invariant = InvariantLinear(linear, cache=False, runs=runs)
    assert invariant.run in runs
    x = torch.randn(TILE_ROWS * 2 + 7, shape[1]).to(dtype)  # wider than a tile: cut, the last tile padded
    with torch.inference_mode():
        alone = torch.cat([invariant(row[None]) for row in x])  # [rows, out]: one call per row
        for width in (1, 2, 3, PAD_ROWS, 5, 9, 31, TILE_ROWS, TILE_ROWS + 1, len(x)):
            for start in (0, 2):
                rows = x[start:start + width]
                assert torch.equal(invariant(rows), alone[start:start + width]), f"width {width} from {start}"
        assert torch.equal(invariant(x.reshape(3, -1, shape[1])).reshape(len(x), -1), alone)  # any leading shape
        # and the model's own values: within the dtype's rounding of torch's linear (int8's: its weights' rounding)
        tolerance = 5e-2 if runs == ("int8",) else 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(alone.float(), linear(x).float(), rtol=tolerance, atol=tolerance)


def test_where_widths_disagree_every_call_is_the_one_shape(monkeypatch):
    from draftwise.backends import kernels

    linear = torch.nn.Linear(64, 96).to(torch.bfloat16)
    monkeypatch.setattr(kernels, "_rows_agree", lambda module, widths: tuple(widths) == (PAD_ROWS,))
    invariant = InvariantLinear(linear, cache=False)
    assert invariant.tile == PAD_ROWS
    calls = []
    real = InvariantLinear.call
    monkeypatch.setattr(InvariantLinear, "call", lambda self, rows: calls.append(len(rows)) or real(self, rows))
    invariant(torch.randn(11, 64).to(torch.bfloat16))
    assert calls == [PAD_ROWS] * 3  # 4 + 4 + 3, the last padded
    monkeypatch.setattr(kernels, "_rows_agree", lambda module, widths: False)
    with pytest.raises(NoInvariantKernel, match="no-batch-invariant"):
        InvariantLinear(linear, cache=False)


# -- a position's logits, whatever the call ------------------------------------------------------------------------

def logits_by_call(backend) -> dict[str, torch.Tensor]:
    """The logits of positions 80-84 of TEXT computed in one-token steps, in a 5-token (verification) pass, in a
    tree pass (as a tree's root, its first child and that child's child, beside a sibling), in one 85-token prefill
    call (wider than a tile), and as a row of a ragged batch of 8 sequences of other lengths. [5, vocab] each, the
    tree's [3, vocab] (positions 80-82)."""
    prefix, new = TEXT[:80], TEXT[80:85]
    views = [backend.open_slot() for _ in range(12)]
    steps, chunk, tree, whole, batched, *others = views
    try:
        steps.prefill(prefix)
        shapes = {"steps": torch.cat([steps.forward([t]) for t in new])}
        chunk.prefill(prefix)
        shapes["verification pass"] = chunk.forward(new)
        tree.prefill(prefix)
        layout = TreeLayout.of((-1, -1, 0))  # root; child new[1], sibling 7; new[2] under new[1]
        rows = backend.forward_batch([(tree, [new[0], new[1], 7, new[2]])], trees=[layout])[0]
        shapes["tree pass"] = rows[[0, 1, 3]]
        shapes["one prefill call"] = whole.forward(prefix + new)[80:]
        batched.prefill(prefix)
        for i, view in enumerate(others):
            view.prefill(TEXT[i:i + 3 + 7 * i])
        calls = [(view, TEXT[50 + i: 50 + i + 1 + i % 4]) for i, view in enumerate(others)]
        shapes["row of a batch of 8"] = backend.forward_batch([*calls[:3], (batched, new), *calls[3:]])[3]
    finally:
        for view in views:
            view.close()
    return shapes


def same_logits_everywhere(shapes: dict[str, torch.Tensor]) -> list[str]:
    """The calls whose logits are not steps' bits."""
    steps = shapes["steps"]
    return [name for name, logits in shapes.items() if not torch.equal(logits, steps[:len(logits)])]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sliding", "wide"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_positions_logits_do_not_depend_on_the_call(arch, dtype):
    model = copy.deepcopy(wide()) if arch == "wide" else tiny_model(arch, 0)
    engine = Engine.from_models(model.to(dtype), tiny_tokenizer(), method="none")
    assert engine.speed_paths["batch_invariant"] is True  # the default on a CPU
    assert set(engine.speed_paths["target_kernels"]) == {"invariant"}
    assert same_logits_everywhere(logits_by_call(engine.target)) == []


# -- every method's tokens, alone, batched, with a cached prompt ---------------------------------------------------

@functools.lru_cache(maxsize=None)
def wide(near: bool = False) -> torch.nn.Module:
    """A Qwen2 of 2 layers as wide as the 1.5B (hidden 1536, 12 query heads of 128 over 2 key/value heads), tiny
    vocabulary, bfloat16: wide enough that without invariance its logits change with the call (the controls), and
    small enough for seconds. near: a draft, its output layer perturbed (kept often, not always)."""
    config_cls, model_cls, extra = ARCHS["qwen2"]
    tokenizer = tiny_tokenizer()
    config = config_cls(vocab_size=len(tokenizer), hidden_size=1536, intermediate_size=1536, num_hidden_layers=2,
                        num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=512,
                        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        if near:
            noise = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1))
            model.lm_head.weight.add_(0.3 * model.lm_head.weight.std() * noise)
    return model.to(torch.bfloat16)


METHODS = ["draft", "draft-tree", "lookup", "lookup-tree", "hybrid", "hybrid-tree", "skip", "hybrid-skip"]
DRAFTED = ("draft", "draft-tree", "hybrid", "hybrid-tree")  # with a draft model


@functools.lru_cache(maxsize=None)
def engine(method: str, invariant: bool = True) -> Engine:
    drafter = wide(near=True) if method in DRAFTED else None
    return Engine.from_models(wide(), tiny_tokenizer(), draft_model=drafter, method=method, batch_invariant=invariant,
                              draft_vocab=200)


def prompt_ids(text: str) -> list[int]:
    return tiny_tokenizer()(text)["input_ids"]


@functools.lru_cache(maxsize=None)
def reference(text: str) -> tuple[int, ...]:
    """none's tokens alone."""
    return tuple(engine("none").generate(text, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids)


def differences(eng: Engine, ks=(1, 4, 8)) -> list[str]:
    """Where eng's tokens are not none's alone: each prompt alone and all of them batched, at each fixed k (a chain
    of 1 runs a padded call, as one of 2 would; of 4 and 8, calls of 5 and 9 rows alone and wider batched)."""
    found = []
    for k in ks:
        for text in PROMPTS:
            got = eng.generate(text, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=k,
                               adaptive=False).token_ids
            if tuple(got) != reference(text):
                found.append(f"k={k}, alone: {text!r}")
        cfg = GenerationConfig.from_options(max_new_tokens=NEW_TOKENS, num_draft_tokens=k, ignore_eos=True,
                                            adaptive=False)
        seqs = decode_together(eng, [prompt_ids(t) for t in PROMPTS], cfg)
        found += [f"k={k}, batched: {text!r}" for seq, text in zip(seqs, PROMPTS)
                  if tuple(seq.context[len(prompt_ids(text)):]) != reference(text)]
    return found


@pytest.mark.parametrize("method", METHODS)
def test_every_method_and_k_gives_nones_tokens_in_bfloat16_alone_and_batched(method):
    assert differences(engine(method)) == []


def test_control_without_invariance_methods_and_batches_change_the_tokens():
    assert differences(engine("lookup", invariant=False), ks=(1, 4)) != []


@pytest.mark.parametrize("method", ["none", "hybrid", "lookup-tree"])
def test_a_prompt_cache_hit_gives_the_same_tokens(method):
    eng = Engine.from_models(wide(), tiny_tokenizer(), draft_model=wide(near=True) if method in DRAFTED else None,
                             method=method, draft_vocab=200)
    eng.enable_prompt_cache(1 << 26)
    shared = PROMPTS[0] * 3  # a long common start: the second prompt restores it from the cache
    first = eng.generate(shared + "x = 1", max_new_tokens=NEW_TOKENS, ignore_eos=True)
    second = eng.generate(shared + "y = 2", max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert second.stats.prompt_cached > 0
    for result, tail in ((first, "x = 1"), (second, "y = 2")):
        assert tuple(result.token_ids) == reference(shared + tail)


@pytest.mark.parametrize("method", ["none", "draft", "hybrid-tree"])
def test_a_seeded_sampled_request_gives_the_same_text_alone_and_batched(method):
    eng = engine(method)
    options = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, seed=7, num_draft_tokens=3)
    alone = [eng.generate(text, **options).token_ids for text in PROMPTS]
    seqs = decode_together(eng, [prompt_ids(t) for t in PROMPTS], GenerationConfig.from_options(**options))
    assert [seq.context[len(prompt_ids(t)):] for seq, t in zip(seqs, PROMPTS)] == alone


# -- switches ------------------------------------------------------------------------------------------------------

def test_the_switch_says_what_ran_and_refuses_what_cannot_be():
    off = Engine.from_models(wide(), tiny_tokenizer(), method="none", batch_invariant=False)
    assert off.speed_paths["batch_invariant"] is False
    assert "invariant" not in off.speed_paths["target_kernels"]
    named = Engine.from_models(wide(), tiny_tokenizer(), method="none", target_kernels=("dense", "onednn"))
    assert named.speed_paths["batch_invariant"] is False  # kernels named by the caller: theirs, not invariance
    with pytest.raises(DraftwiseError, match="target kernels dense, onednn are not"):
        Engine.from_models(wide(), tiny_tokenizer(), method="none", batch_invariant=True,
                           target_kernels=("dense", "onednn"))


def test_the_bench_runs_ours_on_the_switch_it_was_given():
    from draftwise.bench.runners import Runners

    for asked in (True, False):
        runners = Runners(wide(), tiny_tokenizer(), batch_invariant=asked)
        assert runners.engine("none").speed_paths["batch_invariant"] is asked
        assert ("batch-invariant" in runners.engines(["none"], "bfloat16")["none"]) is asked


# -- controls: without invariance the same comparisons see differences ---------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_control_without_invariance_a_positions_logits_change_with_the_call(dtype):
    if dtype == torch.bfloat16 and not onednn_packs(dtype):
        pytest.skip("without oneDNN's bfloat16 torch's own bfloat16 linear computes a row alone: nothing to see")
    off = Engine.from_models(copy.deepcopy(wide()).to(dtype), tiny_tokenizer(), method="none", batch_invariant=False)
    assert same_logits_everywhere(logits_by_call(off.target)) != []


@pytest.mark.real_model
def test_on_a_real_model_in_bfloat16_every_method_gives_nones_tokens():
    """SmolLM2-135M in bfloat16 (its own twin as the draft): every method gives none's tokens, and a position's
    logits are the same bits in a step and in a pass; the control, without invariance, sees them change."""
    name = "smollm2-135m-instruct"
    texts = ["Write a Python function that merges two sorted lists.",  # (code and prose: what lookup finds differs)
             "Summarize the plot of Hamlet in three sentences."]

    def load(method: str, invariant: bool = True) -> Engine:
        return Engine.from_pretrained(name, draft=name if method == "hybrid-tree" else None, method=method,
                                      dtype="bfloat16", backend="hf", batch_invariant=invariant, progress=False)

    def tokens(eng: Engine, method: str) -> list[tuple[int, ...]]:
        return [tuple(eng.generate([{"role": "user", "content": t}], chat=True, max_new_tokens=32, ignore_eos=True,
                                   num_draft_tokens=4, adaptive=False, method=method).token_ids) for t in texts]

    engine = load("hybrid-tree")  # (its sequences may ask for none and lookup too: one load, one calibration)
    assert same_logits_everywhere(real_logits_by_call(engine)) == []
    expected = tokens(engine, "none")
    for method in ("lookup", "hybrid-tree"):
        assert tokens(engine, method) == expected, method
    assert same_logits_everywhere(real_logits_by_call(load("none", invariant=False))) != []  # the control


def real_logits_by_call(eng: Engine) -> dict[str, torch.Tensor]:
    code = "def merge(a, b):\n    out = []\n    while a and b:\n        if a[0] < b[0]:\n"
    text = eng.tokenizer(code * 4)["input_ids"]
    prefix, new = text[:60], text[60:65]
    steps, chunk = eng.target.open_slot(), eng.target.open_slot()
    try:
        steps.prefill(prefix)
        chunk.prefill(prefix)
        return {"steps": torch.cat([steps.forward([t]) for t in new]), "pass": chunk.forward(new)}
    finally:
        steps.close()
        chunk.close()


# -- the server ----------------------------------------------------------------------------------------------------

def test_the_servers_batched_and_streamed_texts_are_the_texts_alone():
    """6 chat requests at temperature 0, one at a time and then all at once, and one streamed: the same texts."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    from draftwise.serve.app import create_app
    from draftwise.serve.command import serve_in_thread
    from draftwise.serve.metrics import ServeMetrics
    from draftwise.serve.scheduler import Scheduler

    metrics = ServeMetrics()
    scheduler = Scheduler(engine("hybrid"), max_batch=8, prefill_chunk=7, metrics=metrics)  # prompts in chunks
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, "wide", metrics, None))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    texts = [*PROMPTS, *(p[::-1] for p in PROMPTS)]

    def chat(text: str) -> str:
        reply = client.chat.completions.create(model="wide", messages=[{"role": "user", "content": text}],
                                               max_tokens=NEW_TOKENS, temperature=0)
        return reply.choices[0].message.content

    try:
        alone = [chat(text) for text in texts]
        with ThreadPoolExecutor(len(texts)) as pool:
            together = list(pool.map(chat, texts))
        stream = client.chat.completions.create(model="wide", messages=[{"role": "user", "content": texts[0]}],
                                                max_tokens=NEW_TOKENS, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        stop()
        scheduler.drain(5)
    assert together == alone
    assert streamed == alone[0]
