"""The package's rooms, drawn from its own imports: no import circles, imports run down the layers only, the
inference path never imports training, and argparse stays in the command modules.

Every `import` and `from ... import` in every module of draftwise counts, at module level or deferred inside a
function (a deferred import is how a circle hides). Each module belongs to the layer whose entry in LAYERS names
it, or the package it is in (the longest such entry), and may import its own layer and the ones below. A new
module must be given a room here: an unplaced one fails.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "draftwise"  # the source tree beside these tests

# Highest first. An entry names a module or a package (all of it, unless a longer entry claims a part); "draftwise"
# alone is the package's own __init__, its public names.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("draftwise.__main__", "draftwise.cli")),
    # What people touch: the commands and their shared options, the HTTP API, the bench and the load driver, and
    # training (apart from the inference path: the rule below keeps the others from importing it).
    ("commands", ("draftwise.bench", "draftwise.serve", "draftwise.train", "draftwise.options")),
    # The loop that batches many sequences, with what it keeps per request (the guard, the proposal log, the
    # captured features).
    ("scheduler", ("draftwise.serve.scheduler", "draftwise.serve.guard", "draftwise.serve.proposal_log",
                   "draftwise.serve.feature_capture")),
    ("public API", ("draftwise",)),  # Engine, Result, DraftwiseError (Engine imported lazily)
    ("engine", ("draftwise.engine",)),  # the facade: construction, generate, stream, what it serves
    # The round for a batch of sequences, the state it keeps per sequence, and what it keeps between rounds: the
    # sequences' lifecycle, the draft-length policies, pooled acceptance, lagging drafts, the text caches, the
    # drafts loaded beside the engine's own, the fallback.
    ("round", ("draftwise.round", "draftwise.sequence", "draftwise.adaptive", "draftwise.lifecycle",
               "draftwise.draft_lengths", "draftwise.acceptance_pools", "draftwise.catch_up", "draftwise.text_caches",
               "draftwise.draft_registry", "draftwise.fallback")),
    ("loading", ("draftwise.loading", "draftwise.loading_llamacpp")),  # names -> models -> an engine's parts
    ("methods", ("draftwise.methods",)),
    # Who guesses, who judges, and what a text must match (a grammar's masks on what the judge reads).
    ("proposers | verify", ("draftwise.proposers", "draftwise.verify", "draftwise.grammar")),
    ("backends", ("draftwise.backends",)),
    ("models", ("draftwise.models",)),
    ("machine and text", ("draftwise.hardware", "draftwise.files", "draftwise.progress", "draftwise.tokenizers",
                          "draftwise.request_text", "draftwise.text", "draftwise.token_text")),
    # Shared vocabulary, and the one cost model (planner.py; estimates.py, what the engine measures), which is pure
    # arithmetic at the bottom because the policy, the proposers' sizing and the metrics all ask it for prices;
    # extras.py, which optional extra brings which package (any layer may need one, so it is at the bottom).
    ("vocabulary", ("draftwise.config", "draftwise.types", "draftwise.metrics", "draftwise.sampling",
                    "draftwise.shared_noise", "draftwise.errors", "draftwise.planner", "draftwise.estimates", "draftwise.extras")),
)
# Imports that may run up a layer, each with its reason.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("draftwise.config", "draftwise.grammar"): "the type of GenerationConfig.grammar, imported for annotations only",
}
# Side by side in one layer, neither imports the other: who guesses and who judges.
SIBLINGS = (("draftwise.proposers", "draftwise.verify"),)
TRAINING = "draftwise.train"
MAY_IMPORT_TRAINING = ("draftwise.cli",)  # to register `train-head`
MAY_IMPORT_ARGPARSE = ("draftwise.__main__", "draftwise.cli", "draftwise.options")  # and every module named *command


# -- the graph ------------------------------------------------------------------------------------------------


def modules_of(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Modules of the package that `name` imports, anywhere in its file -> the first line that does; and the
    outside modules it imports as well (argparse, ...), by their top name."""
    found: dict[str, int] = {}
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # what "." means in this file
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            target = _owning_module(target, modules)
            if target != name:
                found.setdefault(target, node.lineno)
    return found


def _owning_module(dotted: str, modules: dict[str, Path]) -> str:
    """The package's module that `dotted` names (or an attribute of), else the outside module's top name."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return parts[0]


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported module -> line}; draftwise's own modules and the outside ones they import."""
    modules = modules_of(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Import circles among the package's modules, each as [a, b, ..., a]: at least one through every set of
    modules that reach each other."""
    cycles, done, on_path = [], set(), []

    def visit(module: str) -> None:
        if module in on_path:
            cycles.append(on_path[on_path.index(module):] + [module])
            return
        if module in done or module not in graph:
            return
        on_path.append(module)
        for target in sorted(graph[module]):
            visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return cycles


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the module's room (0 is the top), or None when no entry names it."""
    best, best_len = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or (entry != "draftwise" and module.startswith(entry + "."))
            if covers and len(entry) > best_len:
                best, best_len = index, len(entry)
    return best


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _may_import_argparse(module: str) -> bool:
    return module in MAY_IMPORT_ARGPARSE or module.rpartition(".")[2].endswith("command")


def upward_imports(graph) -> list[str]:
    found = []
    for module, targets in graph.items():
        for target, line in targets.items():
            if target in graph and (module, target) not in UPWARD_EXCEPTIONS:
                if None not in (layer_of(module), layer_of(target)) and layer_of(target) < layer_of(module):
                    found.append(f"{module} (line {line}, layer {LAYERS[layer_of(module)][0]!r}) imports {target} "
                                 f"(layer {LAYERS[layer_of(target)][0]!r})")
    return found


def sibling_imports(graph) -> list[str]:
    return [f"{module} (line {line}) imports {target}" for module, targets in graph.items()
            for target, line in targets.items() for a, b in SIBLINGS
            if (_within(module, a) and _within(target, b)) or (_within(module, b) and _within(target, a))]


def training_imports(graph) -> list[str]:
    return [f"{module} (line {line}) imports {target}" for module, targets in graph.items()
            for target, line in targets.items()
            if _within(target, TRAINING) and not _within(module, TRAINING) and module not in MAY_IMPORT_TRAINING]


def argparse_imports(graph) -> list[str]:
    """Modules that import argparse, or import a module that does, without being a command module themselves."""
    parsers = {module for module, targets in graph.items() if "argparse" in targets}
    return [f"{module} (line {line}) imports {target}" for module, targets in graph.items()
            for target, line in targets.items()
            if (target == "argparse" or target in parsers) and not _may_import_argparse(module)]


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGE)


# -- the rules ------------------------------------------------------------------------------------------------


def test_no_import_circles(graph):
    assert [" -> ".join(cycle) for cycle in find_cycles(graph)] == []


def test_every_module_has_a_layer(graph):
    assert [module for module in graph if layer_of(module) is None] == []


def test_imports_run_down_the_layers_only(graph):
    assert upward_imports(graph) == []


def test_who_guesses_and_who_judges_do_not_import_each_other(graph):
    assert sibling_imports(graph) == []


def test_nothing_outside_training_imports_it(graph):
    assert training_imports(graph) == []


def test_argparse_stays_in_the_command_modules(graph):
    assert argparse_imports(graph) == []


# -- the checks can fail ---------------------------------------------------------------------------------------


def test_the_checks_find_a_deferred_circle_an_upward_import_and_argparse(tmp_path):
    # A made-up package: a circle closed by an import inside a function, a vocabulary module that reaches up to
    # the engine, an engine that reaches the training, and argparse outside a command module.
    package = tmp_path / "draftwise"
    (package / "train").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "types.py": "def layout():\n    from draftwise.verify import tree\n",
        "verify/__init__.py": "",
        "verify/tree.py": "from ..types import layout\nimport argparse\n",
        "config.py": "from draftwise import engine\n",
        "engine.py": "from draftwise.train.head import fit\n",
        "train/__init__.py": "",
        "train/head.py": "def fit():\n    pass\n",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    made_up = import_graph(package)
    assert find_cycles(made_up) == [["draftwise.types", "draftwise.verify.tree", "draftwise.types"]]
    assert upward_imports(made_up) == [
        "draftwise.config (line 1, layer 'vocabulary') imports draftwise.engine (layer 'engine')",
        "draftwise.engine (line 1, layer 'engine') imports draftwise.train.head (layer 'commands')",
        "draftwise.types (line 2, layer 'vocabulary') imports draftwise.verify.tree (layer 'proposers | verify')"]
    assert training_imports(made_up) == ["draftwise.engine (line 1) imports draftwise.train.head"]
    assert argparse_imports(made_up) == ["draftwise.types (line 2) imports draftwise.verify.tree",
                                         "draftwise.verify.tree (line 2) imports argparse"]
