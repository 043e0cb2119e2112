"""A/B arms (serve --experiment): a bad arms file says what is wrong, traffic splits by weight (or sticks to a
request field), and a live server labels each response, metric and log row with its arm."""
from __future__ import annotations

import json
import math
import random
import re
import sqlite3
from collections import Counter

import httpx
import openai
import pytest

from conftest import tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.cli import main
from draftwise.errors import DraftwiseError
from draftwise.serve.app import create_app
from draftwise.serve.command import serve_in_thread
from draftwise.serve.experiment import REQUEST_ARM, Experiment
from draftwise.serve.log_command import log_stats
from draftwise.serve.metrics import ServeMetrics
from draftwise.serve.proposal_log import ProposalLog
from draftwise.serve.scheduler import Scheduler

pytest.importorskip("tomllib")  # arms files are TOML: Python 3.11 or newer
MODEL = "tiny"
ARMS = """
by = "user"
[[arm]]
name = "draft-k3"
weight = 2
speculation = { method = "draft", num_draft_tokens = 3, adaptive = false }
[[arm]]
name = "lookup"
speculation = { method = "lookup" }
[[arm]]
name = "off"
speculation = "off"
"""


def arms_file(tmp_path, text: str):
    path = tmp_path / "arms.toml"
    path.write_text(text)
    return path


ARM = '[[arm]]\nname = "a"\nspeculation = "off"\n'
BAD = [
    ("name = ", "is not valid TOML"),
    ('by = "user"\n', "no arms; give each one an \\[\\[arm\\]\\] table"),
    ('[[arms]]\nname = "a"\n', "unknown keys arms; allowed: by, arm"),
    ("by = 3\n" + ARM, "'by' must be the name of a request field"),
    ('[[arm]]\nspeculation = "off"\n', "arm 1 needs a name"),
    (ARM + ARM, "two arms are named 'a'"),
    ('[[arm]]\nname = "request"\nspeculation = "off"\n', "the name 'request' is taken"),
    (ARM + "weight = 0\n", "the weight must be a number > 0, got 0"),
    (ARM + "weight = -2.5\n", "the weight must be a number > 0, got -2.5"),
    (ARM + 'weight = "2"\n', "the weight must be a number > 0, got '2'"),
    (ARM + "weight = 1e308\n" + ARM.replace('"a"', '"b"') + "weight = 1e308\n", "add up past a float's range"),
    (ARM + "k = 4\n", "arm 'a': unknown keys k; allowed: name, weight, speculation"),
    ('[[arm]]\nname = "a"\n', "arm 'a' needs speculation"),
    ('[[arm]]\nname = "a"\nspeculation = { method = "psychic" }\n',
     "arm 'a': speculation method 'psychic' is not available.*choose one of"),
    ('[[arm]]\nname = "a"\nspeculation = { method = "draft", num_draft_tokens = 0 }\n',
     "arm 'a': 'num_draft_tokens' must be an integer in \\[1, 64\\]"),
    ('[[arm]]\nname = "a"\nspeculation = { k = 3 }\n', "arm 'a': unknown 'speculation' fields: k"),
    ('[[arm]]\nname = "a"\nspeculation = 3\n', "arm 'a': 'speculation' must be false, \"off\", or an object"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_bad_arms_file_says_what_is_wrong(tmp_path, text, message):
    with pytest.raises(DraftwiseError, match=message):
        Experiment.load(arms_file(tmp_path, text))


def test_a_missing_file_and_a_method_the_loaded_engine_lacks_are_refused(tmp_path):
    with pytest.raises(DraftwiseError, match="cannot read the arms file"):
        Experiment.load(tmp_path / "missing.toml")
    experiment = Experiment.load(arms_file(tmp_path, ARMS))  # every method exists somewhere
    no_draft = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="lookup")
    with pytest.raises(DraftwiseError, match="arm 'draft-k3': speculation method 'draft' is not available on this "
                                             "server; choose one of: none, lookup"):
        experiment.check(no_draft.methods_available)


def test_serve_refuses_a_bad_arms_file_before_loading_models_or_binding(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))  # nothing is pulled: the file fails first
    bad = arms_file(tmp_path, ARM + "weight = 0\n")
    assert main(["serve", "--experiment", str(bad), "--port", "1"]) == 1
    assert "the weight must be a number > 0" in capsys.readouterr().err
    target = tmp_path / "target"
    tiny_model("llama", 0).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    good = arms_file(tmp_path, ARMS)  # its draft arm needs a draft model this server lacks
    assert main(["serve", "--target", str(target), "--draft", "none", "--experiment", str(good), "--port", "1"]) == 1
    assert "arm 'draft-k3': speculation method 'draft' is not available" in capsys.readouterr().err


def within_4_sigma(observed: int, n: int, p: float) -> bool:
    return abs(observed - n * p) < 4 * math.sqrt(n * p * (1 - p))


def test_random_assignment_splits_by_weight():
    arms = [{"name": "a", "weight": 3, "speculation": "off"}, {"name": "b", "weight": 1, "speculation": {}}]
    experiment = Experiment.parse({"arm": arms}, rng=random.Random(1234))
    counts = Counter(experiment.assign({})[0] for _ in range(2000))
    assert set(counts) == {"a", "b"} and within_4_sigma(counts["a"], 2000, 0.75)
    assert experiment.assign({})[1] in ("off", {})  # an arm's own speculation value


def test_by_a_field_each_value_keeps_its_arm_and_values_spread_by_weight(tmp_path):
    experiment = Experiment.load(arms_file(tmp_path, ARMS), rng=random.Random(0))
    again = Experiment.load(arms_file(tmp_path, ARMS), rng=random.Random(99))  # another process, another seed
    users = [f"user-{i}" for i in range(2000)]
    first = [experiment.assign({"user": u})[0] for u in users]
    assert first == [experiment.assign({"user": u})[0] for u in users] == [again.assign({"user": u})[0]
                                                                           for u in users]
    counts = Counter(first)
    assert within_4_sigma(counts["draft-k3"], 2000, 0.5) and within_4_sigma(counts["off"], 2000, 0.25)
    assert len({experiment.assign({})[0] for _ in range(200)}) == 3  # no user: the random split
    assert experiment.assign({"user": "x", "speculation": "off"}) == (REQUEST_ARM, "off")  # its own choice


# --- a live server with an experiment --------------------------------------------------------------------

def user_for(experiment: Experiment, arm: str, skip: int = 0) -> str:
    """A user the experiment sends to this arm."""
    found = (f"u{i}" for i in range(10_000) if experiment.pick(f"u{i}").name == arm)
    for _ in range(skip):
        next(found)
    return next(found)


@pytest.fixture
def experiment_server(tmp_path):
    experiment = Experiment.load(arms_file(tmp_path, ARMS), rng=random.Random(0))
    engine = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=tiny_model("llama", 1, 1),
                                method="draft")
    experiment.check(engine.methods_available)
    metrics = ServeMetrics(experiment.labels)
    log = ProposalLog(tmp_path / "log.sqlite")
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=8, metrics=metrics, proposal_log=log)
    scheduler.start()
    url, stop = serve_in_thread(create_app(scheduler, MODEL, metrics, experiment=experiment))
    try:
        yield url, experiment, metrics, scheduler, log
    finally:
        stop()
        scheduler.drain(5)
        log.close()


def samples(metrics: ServeMetrics, name: str, **labels) -> float:
    """The sum of a metric's samples named name whose labels include these."""
    return sum(s.value for family in metrics.registry.collect() for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def serve_every_arm(url: str, experiment: Experiment) -> dict[str, list]:
    """Two requests per arm (by user), one that sets its own speculation, one streamed: each arm's responses."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    ask = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0)
    served: dict[str, list] = {}
    for arm in ("draft-k3", "lookup", "off"):
        for i in range(2):
            out = client.completions.create(**ask, user=user_for(experiment, arm, i))
            served.setdefault(out.model_extra["draftwise"]["arm"], []).append(out)
    own = client.completions.create(**ask, user=user_for(experiment, "off"), extra_body={"speculation": "off"})
    served.setdefault(own.model_extra["draftwise"]["arm"], []).append(own)
    chunks = list(client.completions.create(**ask, user=user_for(experiment, "lookup"), stream=True,
                                            stream_options={"include_usage": True}))
    served.setdefault(chunks[-1].model_extra["draftwise"]["arm"], []).append(chunks[-1])  # the usage chunk
    return served


def test_a_live_experiment_labels_responses_metrics_and_log_rows(experiment_server, capsys):
    url, experiment, metrics, scheduler, log = experiment_server
    served = serve_every_arm(url, experiment)
    stats = {arm: [o.model_extra["draftwise"] for o in outs] for arm, outs in served.items()}
    assert {arm: len(s) for arm, s in stats.items()} == {"draft-k3": 2, "lookup": 3, "off": 2, "request": 1}
    assert {arm: {s["method"] for s in ss} for arm, ss in stats.items()} == {
        "draft-k3": {"draft"}, "lookup": {"lookup"}, "off": {"none"}, "request": {"none"}}
    assert {s["num_draft_tokens"] for s in stats["draft-k3"]} == {3}
    assert len({o.choices[0].text for outs in served.values() for o in outs if o.choices}) == 1  # greedy: exact

    for arm, ss in stats.items():
        assert samples(metrics, "draftwise_requests_total", arm=arm) == len(ss)
        assert samples(metrics, "draftwise_time_to_first_token_seconds_count", arm=arm) == len(ss)
        assert samples(metrics, "draftwise_request_seconds_count", arm=arm) == len(ss)
        assert samples(metrics, "draftwise_emitted_tokens_total", arm=arm) == sum(s["new_tokens"] for s in ss)
        for counted in ("proposed", "accepted"):
            total = sum(s[counted] for s in ss)
            assert samples(metrics, f"draftwise_{counted}_tokens_total", arm=arm) == total
            assert samples(metrics, f"draftwise_{counted}_tokens_by_position_total", arm=arm) == total
    assert samples(metrics, "draftwise_proposed_tokens_total", arm="draft-k3", method="draft") > 0
    exposed = httpx.get(f"{url}/metrics").text
    assert re.search(r'^draftwise_requests_total\{.*arm="off".*\} 2\.0$', exposed, re.M)
    assert re.search(r"^draftwise_verification_passes_total \S+$", exposed, re.M)  # step-level: no arm

    scheduler.drain(10)  # every request's row is queued; close() writes them
    log.close()
    by_arm = {row["arm"]: row for row in log_stats(log.path)["by_arm"]}
    assert {arm: row["requests"] for arm, row in by_arm.items()} == {arm: len(ss) for arm, ss in stats.items()}
    for arm, ss in stats.items():
        row = by_arm[arm]
        assert row["proposed"] == sum(s["proposed"] for s in ss) and row["accepted"] == sum(s["accepted"] for s in ss)
        assert row["tokens_per_s"] > 0 and row["ttft_ms"] > 0 and row["tbt_ms"] > 0
    assert by_arm["off"]["mean_accepted_length"] == 1.0 and by_arm["off"]["acceptance"] is None
    assert by_arm["draft-k3"]["mean_accepted_length"] >= 1.0 and by_arm["draft-k3"]["methods"] == ["draft"]
    db = sqlite3.connect(log.path)
    try:
        timing = db.execute("SELECT method, new_tokens, passes, decode_s, ttft_s, last_token_s FROM requests "
                            "WHERE arm = 'off'").fetchall()
    finally:
        db.close()
    assert len(timing) == 2 and all(m == "none" and n == p >= 1 and d > 0 and 0 < t <= last
                                    for m, n, p, d, t, last in timing)

    assert main(["log", "stats", str(log.path)]) == 0
    table = capsys.readouterr().out.split("by arm")[1]
    assert all(f"| {arm} |" in table for arm in ("draft-k3", "lookup", "off", "request"))
    assert main(["log", "stats", str(log.path), "--json"]) == 0
    assert [r["arm"] for r in json.loads(capsys.readouterr().out)["by_arm"]] == sorted(stats)
