"""The table of methods (draftwise/methods.py): a method is one entry plus its proposer, and every surface (the CLI,
bench, the server, the engine) reads the same names from it."""
from __future__ import annotations

import argparse

import pytest
from conftest import tiny_model, tiny_tokenizer

from draftwise import Engine, DraftwiseError
from draftwise.bench.runners import OURS, check_methods
from draftwise.cli import build_parser
from draftwise.methods import BASELINE, METHODS, NEEDS, Method, available_methods, method_names, register
from draftwise.proposers.base import Proposer
from draftwise.serve.protocol import speculation_options
from draftwise.types import Draft

PROMPT = "one two three one two three one two"
N = 24


class RepeatLast(Proposer):
    """A toy proposer: the text's last token, k times over. It needs nothing but the text."""

    def begin(self, prompt_ids, sampling, generator) -> None:
        pass

    def propose(self, context: list[int], k: int, stop_confidence: float = 0.0) -> Draft:
        return Draft(token_ids=(context[-1],) * k)

    def observe(self, num_accepted: int) -> None:
        pass

    def fork(self) -> "RepeatLast":
        return RepeatLast()


REPEAT = Method("repeat", None, "the text's last token, k times over (a test's toy)", lambda parts: RepeatLast())


@pytest.fixture
def repeat():
    """The toy method, in the table for one test: adding a method is this one entry."""
    register(REPEAT)
    yield REPEAT.name
    del METHODS[REPEAT.name]


def _options(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {flag: action for action in sub._actions for flag in action.option_strings}


def _engine(method: str) -> Engine:
    return Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method=method)


def test_a_method_added_to_the_table_runs_through_generate_exactly_as_the_target_alone(repeat):
    engine = _engine(repeat)  # built for it: loading makes its proposer from the table
    assert engine.method == repeat and repeat in engine.methods_available
    options = dict(max_new_tokens=N, ignore_eos=True, adaptive=False)  # a fixed k: it proposes every round
    toy = engine.generate(PROMPT, **options)
    alone = engine.generate(PROMPT, method=BASELINE, **options)
    assert toy.token_ids == alone.token_ids and toy.text == alone.text
    assert toy.stats.proposed > 0 and toy.stats.method == repeat  # it did guess, and was checked like any other
    assert alone.stats.proposed == 0


def test_a_method_that_needs_nothing_is_served_by_every_engine(repeat):
    engine = _engine("lookup")  # another method's engine makes the toy for a sequence that asks (lifecycle.Sequences._new_proposer)
    assert repeat in engine.methods_available
    options = dict(max_new_tokens=N, ignore_eos=True, adaptive=False)
    toy = engine.generate(PROMPT, method=repeat, **options)
    assert toy.token_ids == engine.generate(PROMPT, method=BASELINE, **options).token_ids
    assert toy.stats.method == repeat and toy.stats.proposed > 0


def test_the_clis_choices_and_the_servers_validation_follow_the_table(repeat):
    parser = build_parser()  # built after the entry: its --method choices include it
    for command in ("generate", "serve"):
        method = _options(parser, command)["--method"]
        assert tuple(method.choices) == method_names() and repeat in method.choices
        assert "'repeat' (the text's last token, k times over" in " ".join(method.help.split())
    assert speculation_options({"method": repeat}, _engine("lookup").methods_available) == {"method": repeat}
    assert available_methods(BASELINE)[0] == BASELINE and repeat in available_methods("lookup")


def test_every_method_has_one_help_line_and_a_known_need():
    assert BASELINE in METHODS
    for name, method in METHODS.items():
        assert method.name == name
        assert method.help.strip() and "\n" not in method.help, name
        assert method.needs is None or method.needs in NEEDS, name


def test_config_bench_cli_and_server_read_the_same_names():
    import draftwise.config as config

    names = method_names()
    assert not any(hasattr(config, old) for old in ("METHODS", "LOOKUP_BRANCHES", "HYBRID_PARTS", "HEAD_METHODS",
                                                     "SKIP_METHODS", "DRAFT_METHODS"))  # settings only
    assert sorted(OURS) == sorted(names) and OURS[0] == BASELINE  # bench: the table's, the baseline first
    check_methods(list(names), has_draft=True)
    parser = build_parser()
    for command in ("generate", "serve"):
        assert tuple(_options(parser, command)["--method"].choices) == names
    methods_help = " ".join(_options(parser, "bench")["--methods"].help.split())
    assert all(name in methods_help for name in names)
    engine = _engine("lookup")
    assert set(engine.methods_available) <= set(names)
    for name in engine.methods_available:  # the server accepts exactly what the engine serves
        assert speculation_options({"method": name}, engine.methods_available) == {"method": name}
    with pytest.raises(DraftwiseError, match="unknown method 'medusa'; choose one of: " + ", ".join(names)):
        engine.generate(PROMPT, max_new_tokens=2, method="medusa")


def test_register_refuses_a_name_twice_and_an_entry_without_help():
    with pytest.raises(DraftwiseError, match="already in the table"):
        register(Method(BASELINE, None, "again", lambda parts: None))
    with pytest.raises(DraftwiseError, match="no help line"):
        register(Method("quiet", None, " ", lambda parts: None))
    assert "quiet" not in METHODS
