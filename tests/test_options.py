"""The options generate, serve, bench and train-head share (draftwise/options.py): declared once, one default each,
and --lookup-ngram and --fixed-k reach serve and bench as they reach generate."""
from __future__ import annotations

import argparse

import pytest
from conftest import tiny_model, tiny_tokenizer

from draftwise import DraftwiseError, Engine
from draftwise.bench.command import configs_from_args
from draftwise.bench.runners import Runners
from draftwise.cli import build_parser
from draftwise.config import DEFAULT_DRAFT_TOKENS, DEFAULT_LOOKUP_NGRAM, DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from draftwise.serve.command import request_defaults
from draftwise.serve.protocol import parse

SHARED = {  # flag -> the commands that take it
    "--target": ("generate", "serve", "bench", "train-head"),
    "--dtype": ("generate", "serve", "bench", "train-head"),
    "--device": ("generate", "serve", "bench", "train-head"),
    "--draft": ("generate", "serve", "bench"),
    "--head": ("generate", "serve", "bench"),
    "--method": ("generate", "serve"),
    "-k": ("generate", "serve", "bench"),
    "--fixed-k": ("generate", "serve", "bench"),
    "--lookup-ngram": ("generate", "serve", "bench"),
    "--max-new-tokens": ("generate", "bench"),
}


def _parser_of(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *argv])


def _flags(command: str) -> dict[str, argparse.Action]:
    return {flag: action for action in _parser_of(command)._actions for flag in action.option_strings}


@pytest.mark.parametrize("flag, commands", SHARED.items())
def test_a_shared_option_has_one_default_and_help_everywhere(flag, commands):
    """(generate requires --target, and takes no draft unless given one: the commands that load a default pair do)"""
    actions = [_flags(command)[flag] for command in commands]
    assert len({repr(a.default) for a in actions if a.default is not None and not a.required}) <= 1, flag
    assert all(a.help for a in actions)


def test_the_defaults_are_configs():
    for command in ("generate", "serve", "bench"):
        flags = _flags(command)
        assert flags["-k"].default == DEFAULT_DRAFT_TOKENS == GenerationConfig().num_draft_tokens
        assert flags["--lookup-ngram"].default == DEFAULT_LOOKUP_NGRAM
    assert _flags("generate")["--max-new-tokens"].default == DEFAULT_MAX_NEW_TOKENS == GenerationConfig().max_new_tokens


def test_serve_gives_its_k_and_fixed_k_to_the_requests_that_do_not_say():
    args = _parse("serve", "-k", "6", "--fixed-k", "--lookup-ngram", "5")
    defaults = request_defaults(args)
    assert defaults == {"num_draft_tokens": 6, "adaptive": False} and args.lookup_ngram == 5
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="lookup", lookup_max_ngram=5)
    assert engine.proposer.max_ngram == 5
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 4}
    cfg = parse(body, engine, "tiny", chat=False, speculation=defaults).cfg
    assert (cfg.num_draft_tokens, cfg.adaptive) == (6, False)
    own = parse({**body, "speculation": {"num_draft_tokens": 2, "adaptive": True}}, engine, "tiny", False, defaults).cfg
    assert (own.num_draft_tokens, own.adaptive) == (2, True)  # a request's own speculation wins
    for bad in (("-k", "0"), ("-k", "65"), ("--lookup-ngram", "0")):
        with pytest.raises(DraftwiseError):
            request_defaults(_parse("serve", *bad))


def test_bench_takes_lookup_ngram_and_fixed_k_to_its_engines():
    (cfg,) = configs_from_args(_parse("bench", "--fixed-k", "--lookup-ngram", "5", "--dtype", "float32"))
    assert cfg.fixed_k and cfg.lookup_ngram == 5
    runners = Runners(tiny_model("llama", 0), tiny_tokenizer(), num_draft_tokens=3, lookup_ngram=cfg.lookup_ngram,
                      adaptive=not cfg.fixed_k)
    assert runners.engine("lookup").proposer.max_ngram == 5
    record, _ = runners.run("lookup", tiny_tokenizer().encode("one two three one two three one two"), 12)
    assert record["rounds"] and record["proposed"] >= 0  # it ran, on the engine built with those options
