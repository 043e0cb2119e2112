"""The architectures the quant route runs from the GGUF file alone, each on a tiny file written here (random valid
blocks, the tensors and metadata llama.cpp's converter writes for it: tests/gguf_files.py):

- the same bits as the route before (transformers de-quantizes the file into a float32 model, whose linears are
  then swapped onto the same blocks), so the skeleton is filled with the right tensors, in the right channel order;
- greedy tokens of transformers' float32 de-quantized model of the file on the hf backend, logits within the int8
  rounding of activations (the quant kernel's), where the float model's margin leaves room for it;
- every method's tokens equal `none`'s on the quant backend, alone and batched;
- and a GGUF architecture it cannot run refused by name before any weight is read.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import decode_together, tiny_tokenizer
from gguf_files import write_gguf

from draftwise import Engine
from draftwise.backends.gguf_model import load_gguf_model
from draftwise.backends.qgemm import QuantLinear
from draftwise.backends.quant_layers import OneCallLayer
from draftwise.backends.quant_model import on_gguf_weights, runs_on_blocks
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError
from draftwise.loading import QUANT_ASSEMBLY

# architecture -> the transformers class its file loads as (a Mistral file is a llama file: Llama's class)
ARCHS = {"mistral": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
         "phi3": "Phi3ForCausalLM"}
# whether its decoder layers run in one C call (Mistral's are Llama's) or their parts one by one (extra norms,
# another activation, fused projections the call does not take)
ONE_CALL = {"mistral": True, "qwen3": False, "gemma3": False, "phi3": False}
IDS = [1, 5, 9, 33, 200, 7, 7, 7, 150, 3, 9, 33, 200, 7]  # 14 tokens: past gemma3's 4-token window
NEW = 12
METHODS = ["draft", "draft-tree", "lookup", "lookup-tree", "hybrid", "hybrid-tree", "skip", "hybrid-skip"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf-archs"))


@functools.lru_cache(maxsize=None)
def tiny_file(root: str, arch: str, seed: int = 0, tied: bool = False) -> Path:
    """Weights that average zero (a random model with an offset, or a random tied one, repeats one token whatever
    it is given), over the tiny tokenizer's vocabulary, so that an engine can decode every id the model gives."""
    return write_gguf(Path(root) / f"{arch}-{seed}-{tied}.gguf", arch, seed=seed, vocab=len(tiny_tokenizer()),
                      tied=tied, centred=True)


@functools.lru_cache(maxsize=None)
def native(root: str, arch: str, seed: int = 0, tied: bool = False):
    return load_gguf_model(tiny_file(root, arch, seed, tied), progress=False)


def float_model(path: Path):
    """transformers' own float32 model of the file (its GGUF loader de-quantizes every tensor)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]  # [T, vocab]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_the_file_as_published_gives_the_bits_of_the_route_before(root, arch, tied):
    model, path = native(root, arch, tied=tied), tiny_file(root, arch, tied=tied)
    before = on_gguf_weights(float_model(path), path, progress=False)
    assert type(model).__name__ == ARCHS[arch] and type(model) is type(before) and runs_on_blocks(model)
    assert not any(isinstance(m, torch.nn.Linear) and not isinstance(m, QuantLinear) for m in model.modules())
    layers = model.model.layers
    assert all(isinstance(layer, OneCallLayer) for layer in layers) == ONE_CALL[arch]
    assert torch.equal(logits(model), logits(before))
    # control: another file's weights give other logits
    assert not torch.equal(logits(native(root, arch, seed=1, tied=tied)), logits(before))


def greedy_tokens(model, prompts, new: int = NEW, **options) -> list[list[int]]:
    eng = Engine.from_models(model, tiny_tokenizer(), method="none", **options)
    return [list(eng.generate(list(ids), max_new_tokens=new, ignore_eos=True).token_ids) for ids in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_are_the_float_models_on_the_hf_backend(root, arch):
    prompts = [IDS, *torch.randint(0, 290, (3, 10), generator=torch.Generator().manual_seed(3)).tolist()]
    reference, model = float_model(tiny_file(root, arch)), native(root, arch)
    ours = greedy_tokens(model, prompts, **QUANT_ASSEMBLY)
    theirs = greedy_tokens(reference, prompts, batch_invariant=False)  # the hf backend, transformers' own kernels
    compared = 0
    for prompt, mine, float_tokens in zip(prompts, ours, theirs):
        # on the float model's text, the logits are within the int8 rounding of activations (a percent or two of
        # their range); the tokens are the same up to the first whose float margin does not exceed twice that
        # difference (random weights leave near ties a rounding may flip: past one the texts may part)
        text = prompt + float_tokens
        a = logits(model, text)[len(prompt) - 1:-1]  # [NEW, vocab]
        b = logits(reference, text)[len(prompt) - 1:-1]
        difference = (a - b).abs().max(dim=-1).values  # [NEW]
        assert float(difference.max()) < 0.03 * float(b.abs().max())
        top2 = b.topk(2, dim=-1).values
        same = ((top2[:, 0] - top2[:, 1]) <= 2 * difference).tolist().index(True) if any(
            (top2[:, 0] - top2[:, 1]) <= 2 * difference) else NEW
        assert mine[:same] == float_tokens[:same]
        assert a.argmax(-1)[:same].tolist() == float_tokens[:same]
        compared += same
    assert compared >= len(prompts) * NEW // 4, f"only {compared} tokens before near ties: a weak test"
    # control: another file's float model gives other tokens
    assert greedy_tokens(float_model(tiny_file(root, arch, seed=1)), prompts[:1], batch_invariant=False) != theirs[:1]


@functools.lru_cache(maxsize=None)
def quant_engine(root: str, arch: str, method: str) -> Engine:
    # the draft: the target's own file for the chains (its guesses kept, but where a 4-bit re-rounding of it
    # differs), another seed's for the trees (mostly refused); lookup's guesses come from the looping text
    draft = {"draft": 0, "hybrid": 0, "draft-tree": 1, "hybrid-tree": 1}.get(method)
    draft = None if draft is None else native(root, arch, seed=draft)
    return Engine.from_models(native(root, arch), tiny_tokenizer(), draft_model=draft, method=method,
                              **QUANT_ASSEMBLY)


@functools.lru_cache(maxsize=None)
def baseline(root: str, arch: str, ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(quant_engine(root, arch, "none").generate(list(ids), max_new_tokens=24, ignore_eos=True).token_ids)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_tokens_of_none_alone_and_batched(root, arch, method):
    eng = quant_engine(root, arch, method)
    assert eng.speed_paths["backend"] == "quant"
    # a prompt of the target's own looping text (lookup finds matches), and a plain one
    looping = tuple(IDS) + baseline(root, arch, tuple(IDS))[:12]
    prompts = (looping, tuple(IDS[:6]))
    accepted = proposed = 0
    for prompt in prompts:
        for k in (1, 4):
            result = eng.generate(list(prompt), max_new_tokens=24, ignore_eos=True, num_draft_tokens=k,
                                  adaptive=False)
            assert tuple(result.token_ids) == baseline(root, arch, prompt), f"{arch} {method}, k={k}, alone"
            accepted, proposed = accepted + result.stats.accepted, proposed + result.stats.proposed
    if method in ("draft-tree", "hybrid-tree"):
        assert proposed > accepted  # another model's guesses: refused, and the target's own token taken
    else:
        assert accepted > 0  # guesses were kept, not only offered and refused
    cfg = GenerationConfig.from_options(max_new_tokens=24, num_draft_tokens=4, ignore_eos=True, method=method)
    seqs = decode_together(eng, [list(p) for p in prompts], cfg)
    got = [tuple(seq.context[len(p):]) for seq, p in zip(seqs, prompts)]
    assert got == [baseline(root, arch, p) for p in prompts], f"{arch} {method}, batched"


@pytest.mark.parametrize("arch,why", [("gemma2", "its attention soft cap"), ("qwen3moe", "its experts"),
                                      ("mistral3", "transformers has no GGUF loader"), ("mamba", "")])
def test_an_architecture_it_cannot_run_is_refused_by_name_before_loading(tmp_path, arch, why):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(DraftwiseError, match=f"runs the GGUF architectures .*qwen3.*gemma3.*phi3.* not '{arch}'"
                                             f"[^:]*{why}.*: use --backend llamacpp"):
        load_gguf_model(path, progress=False)
