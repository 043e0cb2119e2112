"""A draft loaded beside the engine's own (a distilled version on trial): sequences that name it draft with it, the
output stays the target's whatever the draft, and the server's rollout judges it by live traffic."""
from __future__ import annotations

import pytest
import torch

from conftest import decode_together, near_model, tiny_model, tiny_tokenizer
from draftwise import Engine
from draftwise.config import GenerationConfig
from draftwise.errors import DraftwiseError

PROMPTS = ["The quick brown fox", "def quicksort(arr):\n", "Summaries copy spans of", "for i in range(10):"]


def ids(prompt):
    return tiny_tokenizer()(prompt)["input_ids"]


def damaged(seed=5):
    """A draft of random weights: it keeps almost none of its guesses."""
    return tiny_model("llama", seed)


def engine(method="draft"):
    return Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), draft_model=near_model("llama"), method=method)


@pytest.mark.parametrize("method", ["draft", "draft-tree", "hybrid"])
def test_a_draft_beside_the_engines_own_drafts_for_the_sequences_that_name_it_and_changes_no_token(method):
    eng = engine(method)
    eng.add_draft("candidate", damaged())
    eng.add_draft("twin", near_model("llama"))
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True, num_draft_tokens=3, adaptive=False)
    plain = decode_together(eng, [ids(p) for p in PROMPTS], GenerationConfig(max_new_tokens=24, ignore_eos=True,
                                                                              method="none"))
    own = decode_together(eng, [ids(p) for p in PROMPTS], cfg)
    bad = decode_together(eng, [ids(p) for p in PROMPTS], GenerationConfig(**{**cfg.__dict__, "draft": "candidate"}))
    twin = decode_together(eng, [ids(p) for p in PROMPTS], GenerationConfig(**{**cfg.__dict__, "draft": "twin"}))
    for seqs in (own, bad, twin):
        assert [s.context for s in seqs] == [s.context for s in plain]
    kept = lambda seqs: sum(s.stats.accepted for s in seqs) / sum(s.stats.proposed for s in seqs)
    # The control: the damaged draft really drafted (it keeps far fewer than the engine's own, which its twin matches).
    assert kept(bad) < 0.5 * kept(own) and kept(twin) == pytest.approx(kept(own))


def test_a_draft_is_named_only_where_loaded_and_for_a_method_that_drafts_with_one():
    eng = engine("draft")
    cfg = GenerationConfig(max_new_tokens=4, draft="v1")
    with pytest.raises(DraftwiseError, match="draft 'v1' is not loaded here; loaded beside the engine's own: none"):
        eng.open_sequence(ids("The fox"), cfg)
    eng.add_draft("v1", damaged())
    with pytest.raises(DraftwiseError, match="method 'lookup' drafts with no draft model"):
        eng.open_sequence(ids("The fox"), GenerationConfig(max_new_tokens=4, draft="v1", method="lookup"))
    queued = eng.check_open(ids("The fox"), GenerationConfig(max_new_tokens=4, draft="v1"))  # named while loaded
    eng.remove_draft("v1")
    assert eng.drafts_available == ()
    # ... and opened after its trial ended: it drafts with the draft in front (the text is the same either way)
    seq = eng.open_sequence(ids("The fox"), GenerationConfig(max_new_tokens=4, draft="v1"))
    assert queued == "draft" and seq.cfg.draft is None
    eng.close_sequence(seq)
    with pytest.raises(DraftwiseError, match="reads 40 token ids"):
        eng.add_draft("small", tiny_model("llama", 1, 1, vocab_size=40))  # another vocabulary: refused at load
    lookup_only = Engine.from_models(tiny_model("llama", 0), tiny_tokenizer(), method="lookup")
    with pytest.raises(DraftwiseError, match="drafts with no draft model of the target's tokenizer"):
        lookup_only.add_draft("v1", damaged())


# ---- the sequential test --------------------------------------------------------------------------------
from draftwise.serve.rollout import CANDIDATE, CURRENT, Rollouts, Samples, likelihood_ratio  # noqa: E402


def looks_until_decided(rng, candidate_speed: float, looks: int = 150, alpha: float = 0.05) -> bool:
    """Whether the test, looked at after every pair of requests, ever rejects "equal" (speeds ~ normal, sd 3)."""
    current, candidate = Samples(), Samples()
    for i in range(looks):
        current.add(rng.gauss(20.0, 3.0), 0, 0)
        candidate.add(rng.gauss(candidate_speed, 3.0), 0, 0)
        if i >= 8 and likelihood_ratio(current, candidate, 0.2 * 20.0) >= 1 / alpha:
            return True
    return False


def test_the_sequential_test_keeps_its_error_rate_however_often_it_looks_and_finds_a_real_difference():
    import random

    rng = random.Random(0)
    false_alarms = sum(looks_until_decided(rng, 20.0) for _ in range(200))
    assert false_alarms <= 0.08 * 200  # alpha 0.05 (with room for 200 draws), though it looked 150 times each
    # The control: a fixed-sample test looked at as often would reject far more often than alpha.
    naive = 0
    for _ in range(200):
        current, candidate = Samples(), Samples()
        for i in range(150):
            current.add(rng.gauss(20.0, 3.0), 0, 0)
            candidate.add(rng.gauss(20.0, 3.0), 0, 0)
            if i >= 8:
                z = (candidate.mean - current.mean) / ((current.variance + candidate.variance) / current.n) ** 0.5
                if abs(z) > 1.96:
                    naive += 1
                    break
    assert naive > 2 * false_alarms
    assert sum(looks_until_decided(rng, 24.0) for _ in range(50)) >= 45  # a 20% difference is found


class FakeStats:
    def __init__(self, tokens_per_s, proposed=10, accepted=5):
        self.new_tokens, self.decode_s, self.proposed, self.accepted = 20, 20 / tokens_per_s, proposed, accepted


class FakeEngine:
    def __init__(self):
        self.loaded, self.draft_in_front = {}, None

    drafts_available = property(lambda self: tuple(self.loaded))
    in_front = property(lambda self: self.draft_in_front)

    def add_draft(self, name, model):
        self.loaded[name] = model

    def remove_draft(self, name):
        del self.loaded[name]

    def promote_draft(self, name):
        self.draft_in_front = name


def trial_of(rollouts, name):
    trial = rollouts.start(name)
    for _ in range(200):
        if trial.state != "loading":
            return trial
        import time
        time.sleep(0.01)
    raise AssertionError("the draft never loaded")


def test_a_faster_candidate_is_promoted_a_slower_one_rolled_back_and_a_bad_one_fails_to_load():
    import random

    engine = FakeEngine()
    rollouts = Rollouts(engine, load=lambda name: object(), rng=random.Random(1))
    trial = trial_of(rollouts, "d@v1")
    assert rollouts.assign({}) in ((CURRENT, None), (CANDIDATE, {"draft": "d@v1"}))
    assert rollouts.assign({"speculation": "off"}) == ("", "off")  # a request's own choice is no sample
    rng = random.Random(2)
    while trial.state == "testing":
        rollouts.observe(CURRENT, FakeStats(rng.gauss(20, 2)), "stop")
        rollouts.observe(CANDIDATE, FakeStats(rng.gauss(26, 2)), "stop")
    assert trial.state == "promoted" and trial.reason.startswith("faster")
    assert engine.in_front == "d@v1" and rollouts.in_front == "d@v1"
    assert rollouts.assign({}) == ("", None)  # no trial: every request on the draft in front

    trial = trial_of(rollouts, "d@v2")
    while trial.state == "testing":
        rollouts.observe(CURRENT, FakeStats(rng.gauss(20, 2)), "stop")
        rollouts.observe(CANDIDATE, FakeStats(rng.gauss(12, 2)), "stop")
        rollouts.observe(CANDIDATE, FakeStats(1000.0), "error")  # a failed request is not a measurement
    assert trial.state == "rolled back" and trial.reason.startswith("slower")
    assert engine.in_front == "d@v1" and engine.drafts_available == ("d@v1",)

    def broken(name):
        raise OSError("no such file")

    rollouts.load = broken
    trial = trial_of(rollouts, "d@v3")
    assert trial.state == "failed" and "no such file" in trial.reason and engine.in_front == "d@v1"
    assert [t["state"] for t in rollouts.summary()["trials"]] == ["promoted", "rolled back", "failed"]


# ---- through HTTP ------------------------------------------------------------------------------------------
KEY = "admin-key"


@pytest.fixture
def rollout_server():
    import random

    from draftwise.serve.app import create_app
    from draftwise.serve.command import serve_in_thread
    from draftwise.serve.metrics import ServeMetrics
    from draftwise.serve.scheduler import Scheduler

    eng = engine("draft")
    versions = {"tiny@v1": damaged, "tiny@v2": lambda: near_model("llama")}
    def check(name):
        if name not in versions:
            raise DraftwiseError(f"no draft version {name}")

    rollouts = Rollouts(eng, load=lambda name: versions[name](), check=check, rng=random.Random(0), max_requests=80)
    metrics = ServeMetrics()
    scheduler = Scheduler(eng, max_batch=4, prefill_chunk=8, metrics=metrics)
    scheduler.start()
    fixed = {"adaptive": False, "num_draft_tokens": 4}  # every round drafts 4: a damaged draft costs plainly
    url, stop = serve_in_thread(create_app(scheduler, "tiny", metrics, KEY, fixed, rollouts=rollouts))
    try:
        yield url, rollouts, metrics
    finally:
        stop()
        scheduler.drain(5)


def test_a_damaged_draft_on_trial_changes_no_text_loses_no_request_and_is_rolled_back(rollout_server):
    import httpx
    import openai

    url, rollouts, metrics = rollout_server
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert httpx.post(f"{url}/admin/drafts", json={"draft": "tiny@v1"}).status_code == 401  # no key, no admin
    assert admin.post("/admin/drafts", json={"draft": "nope@v9"}).status_code == 400
    started = admin.post("/admin/drafts", json={"draft": "tiny@v1"})
    assert started.status_code == 202 and started.json()["trial"]["candidate"] == "tiny@v1"
    assert admin.post("/admin/drafts", json={"draft": "tiny@v2"}).status_code == 409  # one trial at a time

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=30)
    expected = {p: client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                             extra_body={"speculation": "off"}).choices[0].text for p in PROMPTS}
    arms, sent = [], 0
    while rollouts.trials[-1].state in ("loading", "testing") and sent < 200:
        prompt = PROMPTS[sent % len(PROMPTS)]
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        assert out.choices[0].text == expected[prompt]  # whatever the draft: the target's own text
        arms.append(out.model_extra["draftwise"]["arm"])
        sent += 1
    trial = admin.get("/admin/drafts").json()["trials"][-1]
    assert trial["state"] == "rolled back" and trial["reason"].startswith("slower"), trial
    assert trial["arms"]["candidate"]["acceptance"] < trial["arms"]["current"]["acceptance"]
    assert {"candidate", "current"} <= set(arms)
    shown = admin.get("/dashboard/data").json()["drafts"]  # the dashboard's table of trials
    assert shown["trials"][-1]["state"] == "rolled back" and shown["in_front"] == "the server's own draft"
    body = admin.get("/metrics").text
    assert 'draftwise_draft_trials_total{outcome="rolled back"} 1.0' in body
    assert "draftwise_draft_trial_tokens_per_second" in body

    # The next trial, a good draft against the server's own (its twin): no faster, so it is not promoted either
    # way; but it loads, serves and changes no text.
    assert admin.post("/admin/drafts", json={"draft": "tiny@v2"}).status_code == 202
    for prompt in PROMPTS * 3:
        assert client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                         temperature=0).choices[0].text == expected[prompt]
