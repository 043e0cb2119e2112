"""Tiny models from configs (random weights, no download) and a small BPE tokenizer trained here."""
from __future__ import annotations

import copy
import functools
import json
import os
import threading

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
    Qwen2ForCausalLM,
)

CORPUS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Speculative decoding proposes several tokens and the target model checks them in one pass.",
    "Summaries copy spans of the article: the article says that prices rose by ten percent.",
    "for i in range(10):\n    print(i * i)\nreturn sorted(values, key=lambda v: v.score)\n",
] * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of ~300 tokens: real merges, real decoding, built in a fraction of a second."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def shuffled_tokenizer(tokenizer, seed: int = 7) -> tuple[PreTrainedTokenizerFast, list[int]]:
    """(tokenizer with its ids shuffled, special ones too; new id of each old id): the same texts and merges in
    another vocabulary, so that a twin of a model (shuffled_twin) is a draft with another tokenizer that agrees with
    it wherever the two spell a text alike."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    order = torch.randperm(len(tokenizer), generator=torch.Generator().manual_seed(seed)).tolist()
    spec["model"]["vocab"] = {piece: order[i] for piece, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        added["id"] = order[added["id"]]
    shuffled = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                       eos_token=tokenizer.eos_token, bos_token=tokenizer.bos_token)
    shuffled.chat_template = tokenizer.chat_template
    return shuffled, order


def shuffled_twin(model, order: list[int]):
    """A copy of model whose embedding and output rows sit at the shuffled ids: the same model over the shuffled
    vocabulary (its end-of-sequence ids moved too)."""
    twin = copy.deepcopy(model)
    index = torch.tensor(order, device=model.device)  # [vocab]: new id of each old id
    weights = {id(layer.weight): layer.weight for layer in (twin.get_input_embeddings(), twin.get_output_embeddings())}
    with torch.no_grad():
        for weight in weights.values():  # (once for tied embeddings: one tensor for both)
            rows = weight[: len(order)].clone()
            weight[index] = rows
    for config in (twin.config, twin.generation_config):
        eos = config.eos_token_id
        if eos is not None:
            config.eos_token_id = [order[i] for i in eos] if isinstance(eos, list) else order[eos]
    return twin


@functools.lru_cache(maxsize=None)
def piece_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary (Gemma's kind): '▁' for a space, <0xNN> pieces for bytes it has no token
    for, a <bos> put before every text; another tokenizer than tiny_tokenizer() altogether."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=["<pad>", "<eos>", "<bos>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # the byte pieces, as in every SentencePiece vocabulary with byte fallback
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


# Tiny models run fastest on one thread; a second one only adds contention on a 2-core machine.
torch.set_num_threads(1)

# The heaviest files first (seconds of test time on 2 cores, Ice Lake, 2026-12-07): a worker takes a whole file
# (--dist loadfile), so one left for the end runs alone while the other worker idles. With --no-loadscope-reorder
# (the Makefile's) the workers take files in this order, then the rest as collected; a file missing here only
# runs later.
HEAVIEST_FILES = ("test_batch_invariance.py", "test_sampling_e2e.py", "test_replicas.py", "test_llamacpp_backend.py",
                  "test_real_model.py", "test_feature_head.py", "test_quant_backend.py", "test_kernel_isa.py",
                  "test_server.py", "test_cross_tokenizer.py", "test_gguf_model.py", "test_grammar.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: place for place, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept

# Where the tiny models live: the suite runs on the CPU; DRAFTWISE_TEST_DEVICE=cuda runs the engine's tests on a
# GPU (README, "Testing"). The weights are made on the CPU first, so they are the same on either.
TEST_DEVICE = os.environ.get("DRAFTWISE_TEST_DEVICE", "cpu")
# The fast kernels (int8, oneDNN) are CPU kernels: elsewhere every linear stays dense, and tests of them skip.
cpu_kernels = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the timed kernels are CPU kernels")

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    # A window shorter than the tests' texts: the cache must still rewind once the window has filled.
    "mistral-sliding": (MistralConfig, MistralForCausalLM, {"sliding_window": 16}),
}


def time_every_pass_alike(eng, seconds: float = 0.2, draft_step: float | None = None) -> None:
    """Record every verify pass as taking `seconds` at any width (and, given draft_step, each draft forward as
    that, a tree proposer's own timings of its forwards too), so that pricing depends on the text alone, not on
    how this machine runs a tiny model."""
    costs = eng.draft_policy.costs
    real_observe = costs.observe

    def observe(rows, k, draft_s, verify_s, draft_steps=None):
        if draft_step is not None:
            draft_s = draft_step * (k if draft_steps is None else draft_steps)
        real_observe(rows, k, draft_s, seconds, draft_steps)

    costs.observe = observe
    sizing = getattr(eng.proposer, "sizing", None)  # a tree proposer times its own forwards
    if draft_step is not None and sizing is not None:
        real_forwards, real_expansion = sizing.time_forwards, sizing.time_expansion
        sizing.time_forwards = lambda _seconds, forwards: real_forwards(draft_step * max(1, forwards), forwards)
        sizing.time_expansion = lambda nodes, _seconds: real_expansion(nodes, draft_step)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of this dtype here (its bfloat16 wants AVX-512 or AVX-NE-CONVERT): where it
    cannot, the kernels that need it are refused, and what they would show is not there to see."""
    from draftwise.backends.kernels import _pack

    try:
        _pack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2, vocab_size: int | None = None, tokenizer=None):
    """A random causal LM small enough that a forward takes about a millisecond (over tokenizer's vocabulary:
    tiny_tokenizer()'s by default)."""
    config_cls, model_cls, extra = ARCHS[arch]
    tokenizer = tokenizer or tiny_tokenizer()
    config = config_cls(
        vocab_size=vocab_size or len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **extra,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval().to(TEST_DEVICE)
    # Random init is nearly uniform; sharper logits make greedy ties impossible and sampling informative.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def transformers_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """The model's own greedy tokens after ids, from transformers' generate: an implementation independent of ours.
    An explicit mask: without one, generate masks every pad id, and a chat template may hold it."""
    input_ids = torch.tensor([ids], device=model.device)  # [1, prompt]
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@functools.lru_cache(maxsize=None)
def near_model(arch: str = "llama", noise: float = 0.08):
    """tiny_model(arch, 0) with a noisy output layer: a draft that agrees with that target often but not always, so
    rounds keep part of a draft and cut the rest (and a tree's kept path ends anywhere, siblings' included)."""
    draft = tiny_model(arch, 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        draft.lm_head.weight.add_(noise * torch.randn(draft.lm_head.weight.shape, generator=g).to(draft.device))
    return draft


def decode_together(eng, prompts: list[list[int]], cfg) -> list:
    """One sequence per prompt (token ids) under cfg, decoded in one batch to their ends, then closed."""
    return decode_opened(eng, [eng.open_sequence(p, cfg) for p in prompts])


def decode_opened(eng, seqs: list) -> list:
    """Sequences already opened on eng, decoded in one batch to their ends (the scheduler's calls), then closed."""
    try:
        for seq in seqs:
            while not seq.prefill_done:
                eng.prefill(seq)
        while any(seq.finish is None for seq in seqs):
            eng.step([seq for seq in seqs if seq.finish is None])
    finally:
        for seq in seqs:
            eng.close_sequence(seq)
    return seqs


def input_batch(ids: list[int]) -> torch.Tensor:
    """[1, len(ids)] input ids on the tiny models' device, for calling a model directly."""
    return torch.tensor([ids], device=TEST_DEVICE)


@pytest.fixture(scope="session", autouse=True)
def calibration_kept_out_of_the_users_home(tmp_path_factory):
    """The tests measure tiny shapes: keep their choices out of the real $DRAFTWISE_HOME/calibration.

    A test that points DRAFTWISE_HOME elsewhere still gets that home's own calibration folder."""
    from draftwise.backends import kernels
    from draftwise.models.store import store_home

    users_home, scratch = store_home(), tmp_path_factory.mktemp("calibration")
    own_folder = kernels.calibration_dir
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "calibration_dir", lambda: scratch if store_home() == users_home else own_folder())
        yield


@pytest.fixture(scope="session", autouse=True)
def pack_caches_kept_out_of_the_users_home(tmp_path_factory):
    """Loads of the tests' GGUF files write their pack caches (backends/gguf_cache.py) to a scratch folder, not the
    real $DRAFTWISE_HOME/kernels/packed; a test that points DRAFTWISE_HOME elsewhere gets that home's."""
    from draftwise.models import packed
    from draftwise.models.store import store_home

    users_home, scratch = store_home(), tmp_path_factory.mktemp("packed")
    own_folder = packed.cache_dir
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed, "cache_dir", lambda: scratch if store_home() == users_home else own_folder())
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


class FinalEvents:
    """A scheduler sink that keeps each request's final event, in the order they end; wait() blocks for one."""

    def __init__(self):
        self.events = []
        self._ended = threading.Semaphore(0)

    def sink(self, event) -> None:
        if event.finish_reason is not None:
            self.events.append(event)
            self._ended.release()

    def wait(self, timeout: float = 60) -> bool:
        return self._ended.acquire(timeout=timeout)
