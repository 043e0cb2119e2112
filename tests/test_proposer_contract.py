"""The proposer contract (proposers/base.py): every proposer derives from it and declares its capabilities as data,
nothing in the library probes a proposer for members, and the engine runs a proposer that has only the required
ones."""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import draftwise
import draftwise.proposers
from conftest import decode_together, tiny_model, tiny_tokenizer, transformers_greedy
from draftwise.config import GenerationConfig
from draftwise.engine import Engine
from draftwise.methods import LOOKUP_TREE
from draftwise.proposers.base import Capabilities, Proposer
from draftwise.proposers.hybrid import hybrid_of
from draftwise.proposers.prompt_lookup import PromptLookupProposer
from draftwise.types import Draft

PACKAGE = Path(draftwise.__file__).parent


def _proposer_classes() -> list[type]:
    """Every class defined in draftwise/proposers/ that proposes (has a propose method), whatever it derives from."""
    found = []
    for info in pkgutil.iter_modules(draftwise.proposers.__path__):
        module = importlib.import_module(f"draftwise.proposers.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and callable(getattr(cls, "propose", None)):
                found.append(cls)
    return found


def test_every_proposer_class_derives_from_the_contract_and_declares_its_capabilities():
    classes = _proposer_classes()
    names = {cls.__name__ for cls in classes}
    assert {"DraftModelProposer", "DraftTreeProposer", "LayerSkipProposer", "HeadProposer", "PromptLookupProposer",
            "HybridProposer"} <= names  # (the search finds them all, so it would find a new one)
    for cls in classes:
        assert issubclass(cls, Proposer), f"{cls.__name__} does not derive from proposers.base.Proposer"
        # Declared in its class body, or (a proposer built of parts, lookup by its branches) in its constructor.
        declared = "capabilities" in vars(cls) or "self.capabilities =" in inspect.getsource(cls.__init__)
        assert declared, f"{cls.__name__} does not declare its capabilities"
        assert isinstance(cls.capabilities, Capabilities)


def test_capabilities_are_frozen_data():
    capabilities = Capabilities(keeps_cache=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities.keeps_cache = False
    assert dataclasses.replace(capabilities, takes_rows=True) == Capabilities(keeps_cache=True, takes_rows=True)


def test_a_proposer_built_of_parts_declares_what_its_parts_do():
    tree = PromptLookupProposer(branches=3).capabilities
    assert tree.drafts_trees and tree.guesses_free and tree.judges_rounds and not tree.keeps_cache
    assert not PromptLookupProposer().capabilities.drafts_trees
    hybrid = hybrid_of(Minimal(), LOOKUP_TREE).capabilities
    assert hybrid.guesses_free and hybrid.drafts_trees and hybrid.keeps_estimates and not hybrid.judges_rounds


# -- no probes ---------------------------------------------------------------------------------------------------
# A first argument that names a proposer (or a hybrid's parts) is a probe of one, anywhere in the library; inside
# the proposers' own modules, so is any probe of `self` or of what it holds (a proposer probing its parts).
PROPOSER_NAMES = re.compile(r"\b(proposers?|draft|lookup|drafter|base)\b")
# Probes of what is not a proposer although its name says otherwise: the draft's tokenizer, beside the target's.
NOT_PROPOSERS = {("tokenizers.py", "draft")}


def probes_of_proposers(source: str, module: str) -> list[str]:
    """Each getattr/hasattr in source (a module at `module`, relative to the package) applied to a proposer."""
    in_proposers = module.startswith("proposers/")
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args):
            continue
        subject = ast.unparse(node.args[0])
        named = PROPOSER_NAMES.search(subject) and (Path(module).name, subject) not in NOT_PROPOSERS
        if named or (in_proposers and re.match(r"self\b", subject)):
            found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_in_the_library_probes_a_proposer_for_members():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        found += probes_of_proposers(path.read_text(), module)
    assert found == []


@pytest.mark.parametrize("module, line", [
    # How the engine, the hybrid and the batch read proposers before the contract was written.
    ("engine.py", 'draft = getattr(getattr(self.proposer, "draft", self.proposer), "backend", None)'),
    ("engine.py", 'own = getattr(seq.proposer, "acceptances", None)'),
    ("engine.py", 'ok = hasattr(proposer, "restore")'),
    ("sequence.py", 'behind = getattr(self.proposer, "behind", None)'),
    ("proposers/batch.py", 'rows = getattr(proposer, "takes_rows", False)'),
    ("proposers/hybrid.py", 'rows = getattr(self.draft, "takes_rows", False)'),
    ("proposers/hybrid.py", 'shared = getattr(draft, "sizing", None)'),
    ("loading.py", 'layers = getattr(proposer, "draft", proposer).head.config.feature_layers'),
])
def test_the_scan_finds_the_probes_it_forbids(module, line):
    """The control: each of these probes (as the library once had them) is found."""
    assert len(probes_of_proposers(line, module)) >= 1


def test_the_scan_leaves_probes_of_models_and_configs_alone():
    assert probes_of_proposers('name = getattr(model.config, "_name_or_path", "")', "proposers/x.py") == []
    assert probes_of_proposers('same = getattr(target, name) == getattr(draft, name)', "tokenizers.py") == []


# -- the engine with the required members alone -----------------------------------------------------------------
class Minimal(Proposer):
    """The required members only: guesses that the last token repeats (right now and then in the tiny models' text)."""

    def __init__(self, observed: list | None = None):
        self.observed = [] if observed is None else observed  # (num_accepted, k) of every round, its forks' too
        self._k = 0

    def begin(self, prompt_ids, sampling, generator):
        self._k = 0

    def propose(self, context, k, stop_confidence=0.0):
        self._k = k
        return Draft(token_ids=(context[-1],) * k)

    def observe(self, num_accepted):
        assert 0 <= num_accepted <= self._k
        self.observed.append((num_accepted, self._k))

    def fork(self):
        return Minimal(self.observed)


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_engine_runs_a_proposer_with_only_the_required_members(adaptive):
    target, tokenizer = tiny_model("llama", 0), tiny_tokenizer()
    eng = Engine.from_models(target, tokenizer, method="lookup")
    eng.proposer = proposer = Minimal()  # the engine's own: served to the first sequence, forked for the others
    eng.enable_prompt_cache(1 << 24), eng.enable_proposal_cache(4096)  # (a proposer with no cache of either)
    prompts = [tokenizer.encode("the the the quick brown fox"), tokenizer.encode("for i in range(10):")]
    cfg = GenerationConfig(max_new_tokens=24, num_draft_tokens=3, ignore_eos=True, adaptive=adaptive)
    for _ in range(2):  # the second time from the prompt cache
        result = eng.generate(prompts[0], max_new_tokens=24, num_draft_tokens=3, ignore_eos=True, adaptive=adaptive)
        assert result.token_ids == transformers_greedy(target, prompts[0], 24)
    assert result.stats.prompt_cached > 0
    seqs = decode_together(eng, prompts, cfg)  # two live sequences: the second gets a fork
    for seq, prompt in zip(seqs, prompts):
        assert seq.context[len(prompt):] == transformers_greedy(target, prompt, 24)
    if not adaptive:  # a fixed k drafts every round
        assert result.stats.proposed > 0 and len(proposer.observed) > 0
        assert all(k > 0 for _, k in proposer.observed)  # observed after every round it drafted, and no other
