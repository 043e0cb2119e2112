"""The light core: `pip install draftwise` without extras is the library and `draftwise generate`, and a command
that needs an extra says which one to install.

Nothing is uninstalled: each check runs in a fresh interpreter whose first import finder refuses the extras'
packages, as if they were missing, before draftwise is imported.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from draftwise.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# Every extra's packages (starlette comes with fastapi); llama_cpp is the llamacpp extra's.
OPTIONAL = ("fastapi", "starlette", "uvicorn", "prometheus_client", "matplotlib", "httpx", "peft", "ray", "llama_cpp")
CORE_MODULES_ONLY = ("fastapi", "uvicorn", "prometheus-client", "matplotlib", "httpx", "peft")  # never core deps

HIDE = """
class NotInstalled:
    '''Refuses the named top-level packages and everything in them, as if they were not installed.'''
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None

sys.meta_path.insert(0, NotInstalled(HIDDEN))
"""


def run_hidden(code: str, cwd: Path, hidden=OPTIONAL) -> str:
    """Run code in a fresh interpreter, in cwd, with `hidden` not importable; its stdout (it must exit 0).
    conftest (the tiny models) is importable."""
    script = f"HIDDEN = {tuple(hidden)!r}\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\n{HIDE}\n" \
             f"{textwrap.dedent(code)}"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_the_library_and_the_command_line_import_without_the_extras(tmp_path):
    # Every module but the commands' own packages (serve/, bench/, train/), and of those the argparse modules
    # that cli.py registers; then the parser and every command's --help. The first lines check the check: the
    # hidden packages really cannot be imported.
    out = run_hidden("""
        import argparse, contextlib, importlib, io, json, pkgutil
        for name in HIDDEN:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            else:
                raise AssertionError(f"{name} was not hidden")
        import draftwise
        from draftwise import Engine, Result
        imported = []
        for info in pkgutil.walk_packages(draftwise.__path__, "draftwise."):
            parts = info.name.split(".")
            if parts[1] == "__main__" or parts[1] in ("serve", "bench", "train") and not parts[-1].endswith("command"):
                continue
            importlib.import_module(info.name)
            imported.append(info.name)
        from draftwise import cli
        commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
        helped = []
        for command in [[], *([c] for c in commands)]:
            with contextlib.redirect_stdout(io.StringIO()) as text:
                try:
                    cli.main([*command, "--help"])
                except SystemExit as done:
                    assert done.code == 0, (command, done.code)
            assert "usage: draftwise" in text.getvalue(), command
            helped.append(command)
        print(json.dumps({"imported": imported, "helped": helped,
                          "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)}))
    """, tmp_path)
    found = json.loads(out.strip().splitlines()[-1])
    assert {"draftwise.engine", "draftwise.loading", "draftwise.grammar", "draftwise.models.versions",
            "draftwise.cli", "draftwise.serve.command", "draftwise.bench.command", "draftwise.bench.loadgen_command",
            "draftwise.train.command", "draftwise.train.distill_command"} <= set(found["imported"])
    assert {"generate", "serve", "bench", "loadgen", "distill"} <= {c[0] for c in found["helped"] if c}
    assert found["loaded"] == []


def test_generate_runs_without_the_extras(tmp_path):
    # `draftwise generate` end to end, on tiny models in memory (the one loading function replaced, as test_cli does).
    out = run_hidden("""
        from conftest import tiny_model, tiny_tokenizer
        from draftwise import Engine, cli

        target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
        cli._load_engine = lambda args: Engine.from_models(target, tiny_tokenizer(), draft_model=draft)
        argv = ["generate", "--target", "tiny", "--prompt", "The quick brown fox", "--max-new-tokens", "8", "--json"]
        assert cli.main(argv) == 0
    """, tmp_path)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["text"] and 1 <= len(result["token_ids"]) <= 8


def test_a_command_without_its_extra_says_which_to_install(tmp_path):
    # Each command with its extra hidden: exit 1, one line on stderr naming the `pip install` to run. Options that
    # would fail on their own (a missing file) are valid enough to get past argparse; the extra is checked first.
    cases = {"serve": ["serve"], "bench": ["bench"], "loadgen": ["loadgen", "--url", "http://127.0.0.1:9"],
             "distill": ["distill", "missing.sqlite"]}
    out = run_hidden(f"""
        import contextlib, io, json
        from pathlib import Path
        from draftwise import cli
        from draftwise.errors import DraftwiseError
        from draftwise.models.versions import apply_version

        said = {{}}
        for name, argv in {cases!r}.items():
            with contextlib.redirect_stderr(io.StringIO()) as err:
                said[name] = [cli.main(argv), err.getvalue()]
        try:
            apply_version(None, Path("no-such-version"))  # a distilled draft, loaded by generate or serve
        except DraftwiseError as err:
            said["version"] = [1, str(err) + "\\n"]
        print(json.dumps(said))
    """, tmp_path)
    said = json.loads(out.strip().splitlines()[-1])
    extra = {"serve": "serve", "bench": "bench", "loadgen": "bench", "distill": "train", "version": "train"}
    for name, (code, stderr) in said.items():
        assert code == 1, (name, stderr)
        assert stderr.count("\n") == 1 and stderr.endswith(f"pip install 'draftwise[{extra[name]}]'\n"), (name, stderr)
        assert re.search(r"needs (fastapi|uvicorn|prometheus_client|matplotlib|httpx|peft), which is not installed",
                         stderr), (name, stderr)


def test_replicas_without_ray_say_so_with_the_server_installed(tmp_path):
    out = run_hidden("""
        import contextlib, io
        from draftwise import cli
        with contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main(["serve", "--replicas", "2"])
        print(code, err.getvalue(), end="")
    """, tmp_path, hidden=("ray",))
    assert out == ("1 draftwise: error: draftwise serve --replicas (the replicas run on Ray Serve) needs ray, which is "
                   "not installed here: pip install 'draftwise[ray]'\n")


def test_the_core_dependencies_hold_no_extra_and_each_extra_brings_its_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("-", "_")

    core = {name(r) for r in project["dependencies"]}
    assert core.isdisjoint(n.replace("-", "_") for n in CORE_MODULES_ONLY), core
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():  # what `need` names is what pip installs for that extra
        assert {name(r) for r in extras[extra]} == set(modules), extra
    assert {"serve", "bench", "train", "all", "llamacpp", "ray", "test"} <= set(extras)
    assert extras["all"] == ["draftwise[serve,bench,train]"]
