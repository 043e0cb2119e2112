"""Assemble an Engine: resolve names, load models, check the pair, pick the proposer."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from draftwise.backends.hf import HFBackend, embedding_rows, load_model, load_tokenizer
from draftwise.backends.kernels import (DRAFT_KERNELS, DRAFT_WIDTHS, EXACT_KERNELS, INVARIANT, INVARIANT_KERNELS,
                                       TARGET_KERNELS, NoInvariantKernel, kernel_counts, on_timed_kernels)
from draftwise.config import DEFAULT_LOOKUP_NGRAM
from draftwise.errors import DraftwiseError
from draftwise.hardware import check_device
from draftwise.backends.quant import QuantBackend
from draftwise.backends.quant_model import compact_on_blocks, runs_on_blocks
from draftwise.backends.skipping import SkippingBackend
from draftwise.methods import (AUTO_BACKEND, BACKENDS, DEFAULT_BACKEND, DRAFT_MODEL, METHODS, OWN_LAYERS, TRAINED_HEAD,
                               TREES, Parts, check_backend, check_method, choose_method, methods_needing,
                               new_proposer)
from draftwise.proposers.compact import FOUR_BIT, KEEP_VOCAB
from draftwise.proposers.compact import compact_draft as compact
from draftwise.proposers.head_model import check_fits, load_head, parameter_count, readout_layer, require_head
from draftwise.proposers.feature_head import HeadProposer, attention_window
from draftwise.proposers.layer_skip import DraftStack, LayerSkipProposer, cheaper_stack
from draftwise.proposers.skip_calibration import calibration_ids, plan_skip
from draftwise.proposers.cross_vocab import VocabBridge, on_cross_draft
from draftwise.tokenizers import (CROSS_TOKENIZER, SHARED_TOKENIZER, check_draft_reads_every_token, check_same_tokenizer,
                                  draft_path, eos_ids)


HEAD_WIDTHS = (1, 4)  # a head forward: one new position, or one depth of a tree
# The head's linears whose input joins tensors of different scales: the fuse (the next token's embedding beside the
# target's feature) and a fused head's reduce (several layers' features). int8-dynamic quantizes a call's whole
# input with one scale, which the feature's few huge dimensions set, and rounds the embedding away: the head loses
# the token it conditions on, and its held-back accuracy falls by about a quarter (more at depth 2); every other
# linear keeps its accuracy on int8, so only these two stay exact.
EXACT_INPUT_LAYERS = ("fuse", "reduce")


def build_engine(engine_cls, *, target: str, draft: str | None = None, method: str | None = None,
                 dtype: str = "auto", device: str = "cpu", progress: bool = True, head: str | None = None,
                 backend: str = DEFAULT_BACKEND, **lookup):
    """Load by model name, local Hugging Face folder or .gguf path (pulling a known name if needed).

    head: the trained head's folder for the methods head and hybrid-head (default: where `draftwise train-head` puts
    the target's). backend: "hf" (transformers), "quant" (transformers with its linears on the GGUF file's own
    blocks, backends/quant_model.py) or "llamacpp" (the GGUF file as published, loading_llamacpp.py); a method the
    backend cannot serve is refused before anything loads."""
    method = choose_method(method, draft is not None)
    if backend == AUTO_BACKEND:
        backend = auto_backend(target, draft if METHODS[method].needs == DRAFT_MODEL else None, method, device,
                               progress, dtype, lookup.get("batch_invariant"))
    check_backend(backend)
    check_backend(backend, method)
    if backend == "llamacpp":
        from draftwise.loading_llamacpp import build_llamacpp_engine

        if device != "cpu":
            raise DraftwiseError(f"the llama.cpp backend runs on the cpu here, not {device}")
        return build_llamacpp_engine(engine_cls, target=target, draft=draft, method=method, progress=progress,
                                     **lookup)
    need = METHODS[method].needs
    quantized = backend == "quant"
    if quantized:
        dtype = quant_dtype(dtype)
        lookup = {**QUANT_ASSEMBLY, **lookup}
    if need == TRAINED_HEAD:
        from draftwise.models import head_home

        head = head or str(head_home(target))
        require_head(head)  # an instant, before the target loads for minutes
    target_model, tokenizer, draft_model, draft_tokenizer = load_models(
        target, draft if need == DRAFT_MODEL else None, dtype, device, progress, quantized, method)
    return assemble(engine_cls, target_model, tokenizer, method, draft_model, draft_tokenizer, head=head, **lookup)


# How an engine on the quant backend is assembled: its linears' kernel is the quantized one (nothing to time); the
# target's own layers (skip) stay as they are; a float draft model is compacted onto a 4-bit copy of itself (a GGUF
# draft was loaded on 4-bit blocks: load_draft). The draft reads out over twice the float drafts' rows: a 4-bit row
# costs under a third of a bfloat16 one, so the next 32,768 ids add about 8% to a draft forward of the 0.5B (its
# layers 214 MB, those rows 17.6 MB), and they hold three fifths of the target's tokens the smaller readout cannot
# name (about 8% of its output on prose and code has ids past 32,768, 3% past 65,536), each a guess lost.
QUANT_DRAFT_VOCAB = 65536
QUANT_ASSEMBLY = {"target_kernels": ("dense",), "compact_draft": False, "draft_kernels": (FOUR_BIT,),
                  "draft_vocab": QUANT_DRAFT_VOCAB}


def auto_backend(target: str, draft: str | None, method: str, device: str = "cpu", progress: bool = True,
                 dtype: str = "auto", batch_invariant: bool | None = None) -> str:
    """What --backend auto runs: the quant backend on a CPU with AVX2 + FMA (AVX-512 not needed) and a C compiler,
    for a method it serves, with dtype left at auto and batch invariance not declined, when the target (and the
    draft the method uses) have their GGUF files here; otherwise hf (an explicit dtype asks for transformers'
    weights in it, batch_invariant=False for its timed kernels, which only hf has).

    Why quant first: decoding on a CPU is bound by the bytes read a token, and it reads the GGUF's 4- and 6-bit
    blocks where hf reads 16-bit weights; and every piece of it is batch-invariant, so its output is exact."""
    from draftwise.backends import qgemm
    from draftwise.models import check_resolves, resolve

    if device != "cpu" or dtype != "auto" or batch_invariant is False \
            or not check_method(method).asks <= BACKENDS["quant"] or not qgemm.fast_here():
        return DEFAULT_BACKEND
    for name in (target, draft):
        if name is not None:
            check_resolves(name)
            if resolve(name, progress=progress).gguf_path is None:
                return DEFAULT_BACKEND
    return "quant"

def quant_dtype(dtype: str) -> str:
    """The quant backend computes in float32 around its integer kernel: 'auto' means that; another is refused."""
    if dtype not in ("auto", "float32"):
        raise DraftwiseError(f"the quant backend computes in float32 around its integer kernel; --dtype {dtype} "
                             "does not apply (leave it at auto, or use --backend hf)")
    return "float32"


def load_models(target: str, draft: str | None = None, dtype: str = "auto", device: str = "cpu",
                progress: bool = True, quantized: bool = False, method: str | None = None):
    """(target model, tokenizer, draft model or None, the draft's tokenizer or None) by name, folder or .gguf path;
    the pair checked first (for method, where given: a draft with another tokenizer drafts chains alone).

    quantized: the target's linears on its GGUF file's own blocks (the quant backend; dtype float32)."""
    from draftwise.models import check_resolves, resolve  # the store pulls weights; only named models need it

    check_device(device)  # an instant, before a pull or a load of minutes
    for name in (target, draft):  # a typo in either is refused before the other is pulled (minutes, a GB)
        if name is not None:
            check_resolves(name)

    target_source = resolve(target, progress=progress)
    if target_source.adapter is not None:
        raise DraftwiseError(f"{target} is a draft version (`draftwise distill` makes them to draft with): give it "
                             f"as --draft; the target is a model as published")
    tokenizer = load_tokenizer(str(target_source.path), target_source.gguf_file)
    draft_model = draft_tokenizer = None
    if draft is not None:
        draft_source = resolve(draft, progress=progress)
        # Tokenizers load in seconds, models in minutes: refuse a pair the method cannot run before either model.
        # A draft whose tokenizer files are the target's shares its tokenizer (None: assemble's word for that).
        if not same_tokenizer_files(target_source, draft_source):
            draft_tokenizer = load_tokenizer(str(draft_source.path), draft_source.gguf_file)
            if method is not None:
                check_pair_method(method, draft_path(tokenizer, draft_tokenizer))
        # On the quant backend a draft with a GGUF file runs on its blocks too, the wider ones on 4 bits (assemble
        # shrinks its output layer); one without (a folder, a draft version's merged floats) stays float and
        # assemble compacts it onto 4 bits. The target's own file as its draft shares the target's linears.
        if not (quantized and _same_file(target_source, draft_source)):
            draft_model = load_draft(draft_source, dtype, device, progress, quantized)
    if quantized:
        target_model = load_quant_model(target_source, target, progress)
        if draft is not None and draft_model is None:
            draft_model = load_quant_model(draft_source, draft, progress, draft=True, sharing=target_model)
    else:
        floats = target_source.float_weights(progress)  # (a store model's float copy is made on first use)
        target_model = load_model(str(floats.path), floats.gguf_file, dtype, device, progress)
    return target_model, tokenizer, draft_model, draft_tokenizer


# The files a transformers tokenizer is made from (a chat template is not among them: it changes no token's id,
# and the draft's is never applied). Two folders whose files these are, byte for byte, give the same tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def same_tokenizer_files(a, b) -> bool:
    """Whether two resolved sources load the same tokenizer: the same .gguf file, or folders holding the same
    tokenizer files byte for byte (the store's Qwen2.5-Coder 1.5B and 0.5B do)."""
    if a.gguf_file is not None or b.gguf_file is not None:
        return a.gguf_file is not None and b.gguf_file is not None and \
            (a.path / a.gguf_file).resolve() == (b.path / b.gguf_file).resolve()
    if a.path.resolve() == b.path.resolve():
        return True
    found = [name for name in TOKENIZER_FILES if (a.path / name).is_file() or (b.path / name).is_file()]
    return bool(found) and all((a.path / name).is_file() and (b.path / name).is_file()
                               and (a.path / name).stat().st_size == (b.path / name).stat().st_size
                               and (a.path / name).read_bytes() == (b.path / name).read_bytes() for name in found)


def _same_file(a, b) -> bool:
    """Whether two resolved sources are one GGUF file, with no adapter on the draft's (b)."""
    first, second = a.gguf_path, b.gguf_path
    return b.adapter is None and first is not None and second is not None and first.resolve() == second.resolve()


def load_quant_model(source, name: str, progress: bool = True, draft: bool = False, sharing=None):
    """The model of a resolved source on the quant backend: its GGUF file as published (backends/gguf_model.py), no
    float copy of it made; or an error that says how to get a file. draft: a draft's, its blocks wider than 4 bits
    re-quantized to 4 (fewer bytes a forward); sharing: the target loaded from the same file, whose linears the
    draft keeps where it can (left as it is)."""
    from draftwise.backends.gguf_model import load_gguf_model

    gguf = source.published_gguf(name, "the quant backend")
    return load_gguf_model(gguf, config=_saved_config(source), progress=progress, draft=draft, sharing=sharing)


def _saved_config(source):
    """The config.json a store folder keeps beside its GGUF file (saved from the file's metadata), or None: then the
    file's metadata is read."""
    if source.gguf_file is not None or not (source.path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(source.path), trust_remote_code=False)


def load_draft(source, dtype: str, device: str = "cpu", progress: bool = True, quantized: bool = False):
    """The draft model of a resolved source: floats, a draft version (models/versions.py) with its adapter merged;
    quantized (the quant backend): its GGUF file's blocks where it has one and no adapter, those wider than 4 bits
    re-quantized to 4 (a draft's values may move; the target verifies every token)."""
    if quantized and source.adapter is None and source.gguf_path is not None:
        return load_quant_model(source, source.name, progress, draft=True)
    floats = source.float_weights(progress)
    draft_model = load_model(str(floats.path), floats.gguf_file, dtype, device, progress)
    if source.adapter is not None:
        from draftwise.models.versions import apply_version

        draft_model = apply_version(draft_model, source.adapter)
    return draft_model


def draft_version_loader(engine, device: str = "cpu"):
    """load(name) -> the float draft model of a name, in the dtype the engine's own draft was loaded in: what a
    rollout loads beside it (serve/rollout.py)."""
    from draftwise.models import resolve

    quantized = engine.target.backend_name == "quant"
    dtype = "float32" if quantized else engine.speed_paths.get("dtype", "float32")

    def load(name: str):
        source = resolve(name, progress=False)
        check_same_tokenizer(engine.tokenizer, load_tokenizer(str(source.path), source.gguf_file))
        return load_draft(source, dtype, device, progress=False, quantized=quantized)
    return load


def check_pair_method(method: str, path: str) -> None:
    """A draft with another tokenizer drafts chains: refuse a tree method for it, naming the methods it runs."""
    if path == CROSS_TOKENIZER and TREES in METHODS[method].asks:
        chains = [name for name in methods_needing(DRAFT_MODEL) if TREES not in METHODS[name].asks]
        raise DraftwiseError(f"method {method!r} drafts token trees, which a draft with another tokenizer than the "
                             f"target's does not; it runs {' or '.join(chains)}")


def assemble(engine_cls, target_model, tokenizer, method: str | None = None, draft_model=None,
             draft_tokenizer=None, lookup_max_ngram: int = DEFAULT_LOOKUP_NGRAM,
             lookup_min_ngram: int | None = None, compact_draft: bool = True, draft_vocab: int = KEEP_VOCAB,
             target_kernels: tuple[str, ...] | None = None, draft_kernels: tuple[str, ...] | None = None,
             head: str | None = None, loaded_model=None, batch_invariant: bool | None = None):
    """Models already in memory -> Engine. draft_tokenizer: the draft's own tokenizer, where it may differ from the
    target's (the pair check, tokenizers.draft_path, then says which path the draft takes: a cross-tokenizer draft
    drafts through text, proposers/cross_vocab.py); None: the draft shares the target's.

    What the method needs (methods.py) is set up once here: the compact draft model, the trained head or the
    calibrated layer skip; the method's table entry then makes the proposer from it.

    lookup_min_ngram: the shortest match prompt lookup uses; None means 1 for "lookup" and, for the hybrids,
    proposers/hybrid.py's MIN_NGRAM (at most lookup_max_ngram), the match that beats the draft model by rule
    (until the hybrid's pick is measured, and always for a fixed k).

    compact_draft: propose with a cheaper copy of the draft (int8 kernels where faster, an output layer over the
    draft_vocab most common tokens; see proposers/compact.py). Exactness does not depend on it. False: the draft
    computes its own values (in a batch-invariant engine on the invariant kernel, never int8's), so a draft that is
    the target's twin guesses every token right. For skip and hybrid-skip, the same cut applies to the layers the
    draft runs (layer_skip.cheaper_stack); False shares the target's own.

    batch_invariant: every computation of the target (and of a draft model) gives a row the same bits whatever else
    its call holds (kernels.py's invariant kernel, attention.py's row_invariant_attention), so every method and
    every batch gives none's tokens alone, in bfloat16 too. None: on for a CPU model unless target_kernels names
    other kernels (see resolve_invariance).

    target_kernels: the kernels timed for the target's linears, the fastest here kept (backends/kernels.py:
    same values, a flatter cost per verified token); ("dense",) keeps the model as loaded. The model passed
    in is left as it is. draft_kernels: the same for the compact draft, which may also change values (int8).
    Both default to the invariant kernel where batch_invariant holds, else to the timed sets.

    head: for the methods head and hybrid-head, the folder of a head trained for this target (`draftwise train-head`);
    loaded_model: the target as loaded, when target_model was already repacked on kernels (the bench shares one
    such copy among its engines): the head reads out through its output layer's plain weight, and skip's int8
    copies are made from its plain linears."""
    method = choose_method(method, draft_model is not None)
    need = METHODS[method].needs
    # the kernels as resolved, to check them before minutes of work; the target is put on them below
    _, _, drafts = resolve_invariance(batch_invariant, target_model, target_kernels, draft_kernels)
    check_kernels("draft", drafts, (*DRAFT_KERNELS, *INVARIANT_KERNELS, FOUR_BIT))
    if FOUR_BIT in drafts and len(drafts) > 1:
        raise DraftwiseError(f"draft kernel {FOUR_BIT} (every linear on a 4-bit copy) is not timed against others: "
                             f"give it alone; got {', '.join(drafts)}")
    if {*drafts} & {*INVARIANT_KERNELS} and not {*drafts} <= {*INVARIANT_KERNELS}:
        raise DraftwiseError(f"draft kernels {', '.join(INVARIANT_KERNELS)} (batch-invariant) are not timed against "
                             f"others; got {', '.join(drafts)}")
    pair = None
    if need == DRAFT_MODEL:  # before the kernels are timed or a head is read
        pair = SHARED_TOKENIZER if draft_tokenizer is None else draft_path(tokenizer, draft_tokenizer)
        check_pair_method(method, pair)
        if pair != CROSS_TOKENIZER:
            check_draft_reads_every_token(tokenizer, embedding_rows(target_model), embedding_rows(draft_model))
    if need == TRAINED_HEAD and head is None:
        raise DraftwiseError(f"method {method!r} needs the folder of a trained head (head=DIR; see draftwise train-head)")
    # The head reads out through the output layer's weight, which a faster kernel repacks: take it first.
    loaded = loaded_model or target_model  # plain linears, for the head's readout and skip's copies
    drafter = head_proposer(loaded, head) if need == TRAINED_HEAD else None
    target_model, invariant, draft_kernels = on_target_kernels(target_model, batch_invariant, target_kernels,
                                                               draft_kernels)
    target = (QuantBackend if runs_on_blocks(target_model) else HFBackend)(target_model)
    eos = eos_ids(tokenizer, target_model.generation_config, target_model.config)
    keep = [*tokenizer.all_special_ids, *eos]  # the tokens a compact output layer must keep
    paths = {"dtype": str(target.dtype).removeprefix("torch."), "target_kernels": kernel_counts(target_model),
             "backend": target.backend_name, "batch_invariant": invariant}
    if target.backend_name == "quant" or invariant:  # qgemm.c runs its linears or its attention: on which path
        from draftwise.backends.qgemm import kernel_isa, kernel_prefetch

        paths["kernel_isa"], paths["kernel_prefetch"] = kernel_isa(), kernel_prefetch()
    parts = Parts(lookup_max_ngram=lookup_max_ngram, lookup_min_ngram=lookup_min_ngram)
    max_context = target.max_context
    if need == OWN_LAYERS:
        drafter = skip_drafter(target, tokenizer, loaded, target_model, keep, compact_draft, draft_kernels, draft_vocab,
                               paths)
    if need == TRAINED_HEAD:
        target.feature_layers = drafter.feature_layers  # a fused head reads some decoder layers too
        paths["head"] = drafter.speed_paths
    if drafter is not None:
        parts = replace(parts, drafter=lambda: drafter)
    make_draft = None
    if need == DRAFT_MODEL:
        paths["draft_tokenizer"] = pair
        if pair == CROSS_TOKENIZER:
            # A compact output layer keeps the draft's own special tokens; its guesses reach the target as text.
            draft_eos = eos_ids(draft_tokenizer, draft_model.generation_config, draft_model.config)
            keep = [*draft_tokenizer.all_special_ids, *draft_eos]
            draft, token_ids = draft_backend(draft_model, keep, compact_draft, draft_kernels, draft_vocab, paths)
            max_context = min(max_context, draft.max_context)
            bridge = VocabBridge.of(tokenizer, target.vocab_size, eos, draft_tokenizer, embedding_rows(draft_model),
                                    draft_eos)
            parts = replace(parts, on_draft_model=lambda cls: on_cross_draft(cls, draft, bridge, token_ids))
        else:
            make_draft = draft_maker(target.vocab_size, keep, compact_draft, draft_kernels, draft_vocab)
            on_draft, draft = make_draft(draft_model, paths, own=True)
            max_context = min(max_context, draft.max_context)
            parts = replace(parts, on_draft_model=on_draft)
    proposer = new_proposer(method, parts)
    engine = engine_cls(target, tokenizer, proposer, method, eos, max_context, speed_paths=paths)
    engine.draft_maker = make_draft
    return engine


def draft_maker(target_vocab_size: int, keep: list[int], compact_draft: bool, draft_kernels: tuple[str, ...],
                draft_vocab: int):
    """make(draft model, paths, own) -> (on_draft_model: proposer class -> a proposer on the draft, its backend): the
    engine's own draft (own: its first proposer takes the model's default slot) and any loaded beside it later
    (Engine.add_draft: each proposer on a slot of its own) made alike, on the same kernels."""
    def make(draft_model, paths: dict, own: bool = False):
        draft, token_ids = draft_backend(draft_model, keep, compact_draft, draft_kernels, draft_vocab, paths)

        def on_draft_model(cls):
            return cls(draft if own else draft.open_slot(), target_vocab_size=target_vocab_size, token_ids=token_ids)
        return on_draft_model, draft
    return make


def draft_backend(draft_model, keep: list[int], compact_draft: bool, draft_kernels: tuple[str, ...],
                  draft_vocab: int, paths: dict):
    """(the draft model's backend, the target id of each of its logits or None): compact unless told not to.
    Its speed paths go into paths."""
    token_ids = None
    if runs_on_blocks(draft_model):  # already on blocks (4-bit ones, loaded as a draft): only the output layer is cut
        draft_model, token_ids = compact_on_blocks(draft_model, keep, draft_vocab)
    elif compact_draft or draft_kernels == (FOUR_BIT,):
        draft_model, token_ids, *_ = compact(draft_model, keep, draft_vocab, draft_kernels)
    elif {*draft_kernels} <= {*INVARIANT_KERNELS}:  # not compact: the draft's own values, a row's the same in any call
        draft_model = on_timed_kernels(draft_model, (INVARIANT,), DRAFT_WIDTHS)
    draft = HFBackend(draft_model)
    paths["draft_kernels"] = kernel_counts(draft_model)
    paths["draft_vocab"] = draft.vocab_size
    return draft, token_ids


def skip_drafter(target: HFBackend, tokenizer, loaded, target_model, keep: list[int], compact_draft: bool,
                 draft_kernels: tuple[str, ...], draft_vocab: int, paths: dict) -> LayerSkipProposer:
    """The target drafting for itself with the layers a short calibration says pay skipped (on int8 copies where
    faster here, unless compact_draft is False). Its plan goes into paths."""
    stack = DraftStack()
    if compact_draft:  # the layers it runs on int8 copies where faster here, and a compact output layer
        stack = cheaper_stack(loaded, target_model, keep, draft_kernels, draft_vocab)
    plan = plan_skip(target, calibration_ids(tokenizer), stack=stack)
    skipping = SkippingBackend(target, stack.skipping(plan.skip))
    paths["skip_layers"] = list(plan.skip)
    paths["skip_agreement"], paths["skip_cost"] = plan.agreement, plan.cost
    paths["skip_kernels"], paths["skip_vocab"] = skipping.stack.layer_kernels(), skipping.vocab_size
    return LayerSkipProposer(skipping, target_vocab_size=target.vocab_size)


def on_target_kernels(target_model, batch_invariant: bool | None, target_kernels: tuple[str, ...] | None,
                      draft_kernels: tuple[str, ...] | None):
    """(the target as the engine runs it, whether it is batch-invariant, the draft's kernels): resolve_invariance's
    answer, or, where it was the default and no kernel here is batch-invariant after all, the timed kernels."""
    invariant, kernels, drafts = resolve_invariance(batch_invariant, target_model, target_kernels, draft_kernels)
    check_kernels("target", kernels, TARGET_KERNELS, " (the target's own values)")
    try:
        return on_timed_kernels(target_model, kernels), invariant, drafts
    except NoInvariantKernel:
        if batch_invariant:
            raise
    invariant, kernels, drafts = resolve_invariance(False, target_model, target_kernels, draft_kernels)
    return on_timed_kernels(target_model, kernels), invariant, drafts


def resolve_invariance(batch_invariant: bool | None, target_model, target_kernels: tuple[str, ...] | None,
                       draft_kernels: tuple[str, ...] | None) -> tuple[bool, tuple[str, ...], tuple[str, ...]]:
    """(whether the engine is batch-invariant, the target's kernels, the draft's kernels).

    None asks for the default: batch-invariant for a model on the CPU (its kernels are CPU kernels) where the
    attention kernel can be compiled, unless target_kernels names others. A model already on the quant backend's
    blocks is batch-invariant by construction, and its kernels are what QUANT_ASSEMBLY says."""
    if runs_on_blocks(target_model):
        if batch_invariant is False:
            raise DraftwiseError("the quant backend is batch-invariant by construction: it has no other path "
                                 "(use --backend hf for one)")
        return True, target_kernels or ("dense",), draft_kernels or DRAFT_KERNELS
    explicit = target_kernels is not None and INVARIANT not in target_kernels
    if batch_invariant is None:
        batch_invariant = not explicit and invariance_available(target_model)
    elif batch_invariant:
        if explicit:
            raise DraftwiseError(f"batch invariance runs the target on the {INVARIANT} kernel; target kernels "
                                 f"{', '.join(target_kernels)} are not (leave them out, or batch_invariant=False)")
        if next(target_model.parameters()).device.type != "cpu":
            raise DraftwiseError("batch-invariant kernels are CPU kernels here; on another device load with "
                                 "batch_invariant=False (--no-batch-invariant)")
        from draftwise.backends.qgemm import compiler

        compiler()  # its attention kernel is compiled C: an error that says what to install
    if batch_invariant:
        return True, (INVARIANT,), draft_kernels or INVARIANT_KERNELS
    return False, target_kernels or EXACT_KERNELS, draft_kernels or DRAFT_KERNELS


def invariance_available(model) -> bool:
    """Whether batch invariance can run model here: on the CPU, with a C compiler for its attention kernel."""
    from draftwise.backends.qgemm import find_compiler

    return next(model.parameters()).device.type == "cpu" and find_compiler() is not None


def check_kernels(model: str, kernels: tuple[str, ...], allowed: tuple[str, ...], why: str = "") -> None:
    """Refuse an empty or unknown choice of kernels for a model, saying which are allowed."""
    if not kernels or set(kernels) - set(allowed):
        raise DraftwiseError(f"{model} kernels must be some of {', '.join(allowed)}{why}; "
                             f"got {', '.join(kernels) or 'none'}")


def head_proposer(target_model, folder: str) -> HeadProposer:
    """The feature head in `folder`, in the target's dtype, reading out through the target's own output layer.

    The head is a draft: its linears (the readout's too) run on the fastest kernel measured here, int8 included,
    as the compact draft's do; only acceptance can move. Except those that read several sources side by side
    (EXACT_INPUT_LAYERS)."""
    head, ids = load_head(folder, dtype=target_model.dtype, device=target_model.device)
    check_fits(head.config, target_model, folder)
    parameters = parameter_count(head)  # (a repacked linear keeps its weight as a buffer)
    exact = {name: on_timed_kernels(nn.Sequential(head.get_submodule(name)), EXACT_KERNELS, HEAD_WIDTHS)[0]
             for name in EXACT_INPUT_LAYERS if name in head.joining_layers()}
    for name in exact:  # out while the rest is timed and repacked: an int8 copy of them would only be thrown away
        setattr(head, name, nn.Identity())
    head = on_timed_kernels(head, DRAFT_KERNELS, HEAD_WIDTHS)
    for name, layer in exact.items():
        setattr(head, name, layer)
    readout = nn.Sequential(readout_layer(target_model, ids))
    readout = on_timed_kernels(readout, DRAFT_KERNELS, HEAD_WIDTHS)[0]
    proposer = HeadProposer(head, readout, ids, target_model.get_input_embeddings(),
                            window=attention_window(head.config))
    proposer.speed_paths = {"folder": str(folder), "parameters": parameters, "readout": len(ids),
                            "kernels": kernel_counts(head)}
    return proposer
