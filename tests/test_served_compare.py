"""The served comparison (draftwise serve against llama-server, by loadgen): the arms' server arguments, a run of
stand-in arms (loadgen's stand-in servers, draftwise and llama.cpp kinds, on 127.0.0.1), and the table."""
from __future__ import annotations

import json

from draftwise.bench.llamacpp_server import LlamaServer, ServerSpec
from draftwise.bench.load_plan import LoadPlan
from draftwise.bench.prompts import default_prompts, select_prompts
from draftwise.bench.served_compare import Arm, comparison_table, llama_arms, run_arms
from test_bench_lcpp import fake  # noqa: F401 (the fake llama-server, a fixture)
from test_loadgen import OPENAI_FIELDS, StandIn


def test_a_served_llama_server_has_four_slots_and_its_prompt_cache(tmp_path):
    bench = ServerSpec(tmp_path / "t.gguf").arguments("127.0.0.1", 1)
    served = ServerSpec(tmp_path / "t.gguf", slots=4, prompt_cache=True).arguments("127.0.0.1", 1)
    assert bench[bench.index("-np") + 1] == "1" and "--cache-ram" in bench  # the bench's: one request alone
    assert served[served.index("-np") + 1] == "4" and "--cache-ram" not in served


def test_the_llama_arms_start_with_and_without_the_draft(tmp_path, fake, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DRAFTWISE_LLAMA_SERVER", str(fake.path))
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    for path in (target, draft):
        path.write_bytes(b"GGUF")
    for arm in llama_arms(target, draft):
        server = arm.start()
        assert isinstance(server, LlamaServer) and server.props()["build_info"] == "b9999-fake"
        server.close()
    drafted, plain = fake.entries("argv")
    assert drafted[drafted.index("-md") + 1] == str(draft) and drafted[drafted.index("-np") + 1] == "4"
    assert drafted[drafted.index("--spec-type") + 1] == "ngram-mod,draft-simple"
    assert drafted[drafted.index("-c") + 1] == "8192"
    assert "-md" not in plain and "--spec-type" not in plain and plain[plain.index("-np") + 1] == "4"


def test_stand_in_arms_run_in_turn_sampled_and_the_table_has_the_ratios(tmp_path):
    started, servers = [], {"draftwise": StandIn(), "llama": StandIn(kind="llama.cpp")}
    arms = [Arm(name, lambda name=name: started.append(name) or servers[name]) for name in ("llama", "draftwise")]
    plan = LoadPlan(url="http://127.0.0.1:1", levels=(1, 2), modes=("on",), requests=2, max_tokens=4,
                    prompts=tuple(select_prompts(default_prompts(), "all", 1)), temperature=0.7, seed=3)
    rows = run_arms(arms, plan, tmp_path, log=lambda line: None)
    assert started == ["llama", "draftwise"] and list(rows) == ["llama", "draftwise"]
    for server in servers.values():  # (each stopped by run_arms)
        assert all(b["temperature"] == 0.7 and "seed" in b and not set(b) - OPENAI_FIELDS for _, b in server.posts)
    meta = json.loads((tmp_path / "arm0" / "results.json").read_text())["meta"]
    assert meta["server"] == "llama.cpp llama-server b7777-standin" and meta["temperature"] == 0.7
    table = comparison_table(rows, "draftwise")
    lines = table.splitlines()
    assert lines[0] == "| concurrency | llama tok/s | draftwise tok/s | draftwise / llama |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 1", "| 2"] and all("x |" in l for l in lines[2:])


def test_the_table_from_made_up_rows():
    rows = {"ll": [{"concurrency": 1, "tokens_per_s": 10.0, "failed": 0},
                   {"concurrency": 4, "tokens_per_s": 20.0, "failed": 1}],
            "dw": [{"concurrency": 1, "tokens_per_s": 12.0, "failed": 0},
                   {"concurrency": 4, "tokens_per_s": None, "failed": 8}]}
    lines = comparison_table(rows, "dw").splitlines()
    assert lines[2] == "| 1 | 10.0 | 12.0 | 1.20x |"
    assert lines[3] == "| 4 | 20.0 (1 failed) | - (8 failed) | - |"
