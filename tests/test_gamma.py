"""Adaptive gamma (engine/gamma.py): its decisions on synthetic acceptance and costs, and the
engine's output whatever gamma each step uses: greedy adaptive equals gamma 0, both families."""

from __future__ import annotations

import pytest

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.gamma import GammaPolicy, bucket_of
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.hooks import watch
from observe import Around

from test_continuous import WORK, _make, _run, glm5next_models


@pytest.fixture(scope="module")
def glm5(spec_runtime):
    return spec_runtime


@pytest.fixture(scope="module")
def glm5next(tmp_path_factory):
    return glm5next_models(tmp_path_factory.mktemp("glm5next_gamma"))


def _policy(rate: float, costs: dict[int, float], active: int = 1, gamma: int = 4) -> GammaPolicy:
    """A policy that saw drafts accepted independently with probability `rate` per position (as
    counts: 1000 sequences' worth) and step costs per gamma at this batch."""
    p = GammaPolicy(gamma, "adaptive")
    for k in range(gamma):
        p.tried[k] = 1000.0
        p.kept[k] = 1000.0 * rate
    for g, sec in costs.items():
        for _ in range(p.warm):
            p.record_cost(active, g, sec)
    return p


def test_fixed_policy_always_drafts_gamma():
    p = GammaPolicy(3, "fixed")
    p.record_cost(1, 3, 1.0)
    assert p.gammas() == [3] and {p.choose(a) for a in (1, 8, 64)} == {3}


def test_cheap_drafts_with_high_acceptance_draft_the_most():
    # verify nearly flat in rows (small batch, memory bound), a draft 10% of a verify
    p = _policy(0.9, {0: 1.0, 4: 1.4})
    assert p.choose(1) == 4
    assert p.expected_tokens(4) == pytest.approx(1 + 0.9 + 0.81 + 0.729 + 0.6561)


def test_drafting_turns_off_when_it_does_not_pay():
    # a large batch: verifying g + 1 rows costs ~ g + 1 rows' compute; acceptance middling
    p = _policy(0.5, {0: 1.0, 4: 5.0}, active=64)
    assert p.choose(64) == 0
    # the same acceptance at batch 1, where drafting is cheap, pays
    for _ in range(p.warm):
        p.record_cost(1, 0, 1.0)
        p.record_cost(1, 4, 1.3)
    assert p.choose(1) > 0


def test_middle_gamma_wins_when_later_drafts_rarely_pass():
    p = _policy(0.0, {0: 1.0, 4: 1.8})
    p.kept = [900.0, 300.0, 100.0, 30.0]  # draft 1 usually passes, later ones rarely
    p.tried = [1000.0] * 4
    # E: g1 1.9 / 1.2, g2 2.17 / 1.4, g3 2.2 / 1.6, g4 2.2 / 1.8: g = 1 is the best rate
    assert p.choose(1) == 1


def test_a_gamma_below_the_maximum_must_predict_more_than_the_margin():
    """Leaving --gamma takes more than `margin` of predicted gain: a few percent is within the
    estimate's own errors (drifting costs, a straight line between measured gammas)."""
    p = _policy(0.8, {0: 1.0, 3: 3.0}, active=64, gamma=3)
    # E(1) 1.8 on the line's 1.667: 1.080 tokens per unit against gamma 3's 2.952 / 3 = 0.984, 9.8% ahead
    assert p.choose(64) == 1
    p.margin = 0.10
    assert p.choose(64) == 3
    p.margin = 0.05
    for _ in range(p.warm):
        p.record_cost(64, 1, 1.75)  # measured: 1.029, 4.5% ahead (gamma 2 on the new line 4.4%)
    assert p.choose(64) == 3


def test_both_ends_are_measured_before_judging_and_probing_resumes_drafting():
    p = GammaPolicy(3, "adaptive", probe_every=4, probe_max=8, warm=2, warm_judged=6)
    for _ in range(3):
        p.record_cost(2, 3, 3.0)
        p.record_cost(2, 0, 1.0)
    p.record_acceptance([3, 3], [0, 3])  # draft 1 judged twice, drafts 2 and 3 once
    assert p.choose(2) == 3  # costs known, but not the rates: every position needs 6 judgements
    p.record_acceptance([3, 3], [3, 3])
    p.record_acceptance([3, 3], [3, 3])
    assert p.rates_warm is False and p.choose(2) == 3 and p.rates_warm is False
    p.record_acceptance([3, 3], [3, 3])
    p.costs.clear()
    assert p.choose(2) == 3  # rates warm now (for good); no cost at gamma yet
    assert p.rates_warm
    p.record_cost(2, 3, 3.0)
    assert p.choose(2) == 3  # one measurement is not enough
    p.record_cost(2, 3, 3.0)
    assert p.choose(2) == 0  # no cost at 0 yet
    p.record_cost(2, 0, 1.0)
    p.record_cost(2, 0, 1.0)
    p.kept = [0.0, 0.0, 0.0]  # nothing accepted lately: drafting cannot pay
    picks = [p.choose(2) for _ in range(28)]
    # after 4 choices at 0 a probe at gamma; each failed probe doubles the gap, up to 8
    assert [i for i, g in enumerate(picks) if g] == [3, 11, 19, 27] and set(picks) == {0, 3}
    p.kept = list(p.tried)  # drafts pass again: drafting back on, the gap back to 4
    assert p.choose(2) == 3 and p.probe_gap[2] == 4


def test_a_smaller_bucket_is_judged_on_a_larger_ones_line_until_its_own_is_measured():
    """A continuous run's tail shrinks through smaller buckets: they take the verdict of the
    smallest larger bucket whose line is measured instead of running gamma 0 again to measure it."""
    p = _policy(0.9, {0: 1.0, 3: 2.0}, active=64, gamma=3)
    assert p.choose(20) == 3 and p.choose(1) == 3  # no warm-up at 0 in buckets 32 and 1
    assert p.line(20) is p.costs[64]
    for _ in range(p.warm):
        p.record_cost(8, 0, 1.0)
        p.record_cost(8, 3, 9.0)  # bucket 8 measured drafting as a loss: its own line now decides
    assert p.choose(8) == 0 and p.choose(5) == 0 and p.choose(2) == 0  # ... and is the nearest lender below
    assert p.choose(128) == 3 and p.line(128) is None  # nothing larger was measured: measure first
    # a verdict of 0 lent to a smaller bucket is checked by its probes, which measure its own line
    q = _policy(0.9, {0: 1.0, 3: 9.0}, active=64, gamma=3)
    picks = [q.choose(4) for _ in range(q.probe_every)]
    assert picks[:-1] == [0] * (q.probe_every - 1) and picks[-1] == 3


def test_steps_below_gamma_probe_it_so_stale_rates_of_undrafted_positions_refresh():
    """H200, HumanEval batch 8: the first steps' low acceptance put drafts 2 and 3 at ~0.4, gamma 1
    won, and as gamma-1 steps never judge draft 2 its rate stayed 0.4 for 63 steps. A probe at
    --gamma after `probe_every` steps below it judges every position again."""
    p = _policy(0.9, {0: 0.9, 1: 1.7, 3: 2.3}, active=8, gamma=3)  # batch 8's measured step costs, ms
    p.tried, p.kept = [500.0, 40.0, 40.0], [450.0, 16.0, 16.0]  # a = 0.9, 0.4, 0.4 from the first steps
    p.margin = 0.0  # the probe alone (with the margin, gamma 2's shrinking lead gives way after 4 steps)
    picks = []
    for _ in range(2 * p.probe_every):
        g = p.choose(8)
        picks.append(g)
        p.record_acceptance([g] * 8, [g] * 8)  # the text is predictable now: every draft passes
    first = picks.index(3)
    # gamma 2 wins and its steps refresh draft 2's rate, never draft 3's: a probe ends the run at 2
    assert first == p.probe_every - 1 and set(picks[:first]) == {2}
    assert set(picks[first:]) == {3} and p.probe_gap[8] == p.probe_every  # its judgements turned gamma 3 on


def test_h200_batch_1_drafts_despite_one_slow_step():
    """The first H200 run's batch 1 (glm5-nano bf16): a step costs 0.72 ms at gamma 0 and 1.73 ms at
    gamma 3 (TPOT 0.499 ms x MAL 3.46), drafts pass ~87% per position. One gamma-3 step that took
    15 ms (a first replay, or the eager catch-up the first version charged to it) must not turn
    drafting off: an average seeded by it did (15 -> 12.3 -> 10.2 ms), the median does not."""
    p = _policy(0.87, {0: 0.72e-3}, gamma=3)
    for sec in (15e-3, 1.73e-3, 1.73e-3):
        p.record_cost(1, 3, sec)
    assert p.choose(1) == 3
    assert p.expected_tokens(3) / p.cost(1, 3) > 1.3 / p.cost(1, 0)


def test_expensive_drafts_at_a_large_batch_turn_drafting_off():
    # batch 64: gamma 0 at 1.04 ms a step; drafting 3 and verifying 4 rows per sequence ~5 ms
    p = _policy(0.6, {0: 1.04e-3, 3: 5e-3}, active=64, gamma=3)
    assert p.choose(64) == 0 and p.choose(33) == 0


def test_acceptance_rates_are_conditional_and_roll():
    p = GammaPolicy(3, "adaptive", window=4)
    p.record_acceptance([3, 3, 3, 2], [3, 1, 0, 2])
    # draft 1 judged 4 times (3 kept); draft 2 judged 3 times (2 kept); draft 3 judged once (by the
    # first sequence: the last proposed only 2), kept
    assert p.rates() == pytest.approx([3 / 4, 2 / 3, 1.0])
    for _ in range(40):
        p.record_acceptance([3], [0])
    assert p.rates()[0] < 0.01  # old steps fade


def test_costs_interpolate_between_measured_gammas_per_bucket():
    p = GammaPolicy(4, "adaptive", warm=2)
    for _ in range(2):
        p.record_cost(3, 0, 1.0)
        p.record_cost(4, 4, 3.0)  # 3 and 4 active share bucket 4
    assert bucket_of(3) == bucket_of(4) == 4 and bucket_of(1) == 1 and bucket_of(5) == 8
    assert p.cost(3, 2) == pytest.approx(2.0)
    assert p.cost(8, 2) is None
    p.record_cost(4, 1, 9.0)  # one step at gamma 1 (its graphs' first replay) is not its cost yet
    assert p.cost(4, 1) == pytest.approx(1.5) and p.cost(4, 2) == pytest.approx(2.0)
    p.record_cost(4, 1, 1.2)
    assert p.cost(4, 1) == pytest.approx(5.1) and p.cost(4, 2) == pytest.approx(4.4)  # now measured


def test_bad_policy_is_refused():
    with pytest.raises(UserError, match="--gamma-policy"):
        EngineConfig(gamma=3, gamma_policy="sometimes")


@pytest.fixture(params=["glm5", "glm5next"])
def family(request):
    return request.param


@pytest.fixture
def models(family, request):
    return request.getfixturevalue(family)


def _adaptive(engine, probe_every: int = 3):
    """An adaptive policy that finds gamma 0 nearly free (so it turns drafting off) and probes gamma 3
    every `probe_every`-th step: steps run with and without drafts. Its costs stay the seeded ones;
    the engine's measurements are collected in `measured` as (gamma, seconds)."""
    engine.policy = policy = GammaPolicy(3, "adaptive", probe_every=probe_every, warm_judged=0)
    for active in (1, 2):
        for _ in range(policy.warm):
            policy.record_cost(active, 0, 1e-9)
            policy.record_cost(active, 3, 1.0)
    measured = []
    policy.record_cost = lambda active, g, sec: measured.append((g, sec))
    used = []

    def spy(engine, choose, active):
        used.append(choose(active))
        return used[-1]

    watch(engine, Around({"choose_gamma": spy}))
    return used, measured


def test_adaptive_greedy_equals_gamma_0(family, models):
    base, pools = _make(family, models, 0, 2)
    want = [r.tokens for r in _run(base, pools, 2)]
    engine, pools = _make(family, models, 3, 2)
    used, _ = _adaptive(engine)
    assert [r.tokens for r in _run(engine, pools, 2)] == want
    assert 0 in used and 3 in used, used


def test_a_run_reports_its_steps_per_gamma_and_its_admissions(glm5):
    """generate's and bench's `gamma_steps` and `admissions`: at batch 1 every verify step is one
    batch step, and each of the 3 requests is admitted in a phase of its own."""
    from glm5mtp_cli.engine.run import run_generate
    from glm5mtp_cli.engine.sampling import SamplingParams

    for policy in ("fixed", "adaptive"):
        _, acc, lat, _, _ = run_generate(glm5, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], EngineConfig(gamma=3, max_new_tokens=10, sampling=SamplingParams(), batch_size=1, max_seq_len=64, alloc="budget", draft_conf_tau=None, eos_ids=(), gamma_policy=policy, graphs="eager"))
        assert sum(lat["gamma_steps"].values()) == acc.steps > 0 and lat["admissions"] == 3
        assert policy == "adaptive" or lat["gamma_steps"] == {"3": acc.steps}


def test_adaptive_in_static_mode_equals_gamma_0(glm5):
    """The static forwards (CUDA graphs' path) for every gamma, and the backlog a run of steps
    without drafts leaves for the drafter's next catch-up."""
    base, pools = _make("glm5", glm5, 0, 2)
    want = [r.tokens for r in _run(base, pools, 2)]
    engine, pools = _make("glm5", glm5, 3, 2, mode="static")
    used, _ = _adaptive(engine)
    assert [r.tokens for r in _run(engine, pools, 2)] == want
    assert 0 in used and 3 in used, used


def test_adaptive_sampling_frees_everything(glm5):
    engine, pools = _make("glm5", glm5, 3, 2, sampling=SamplingParams(temperature=0.8, seed=1))
    used, _ = _adaptive(engine)
    res = _run(engine, pools, 2)  # asserts nothing stays held
    assert [len(r.tokens) for r in res] == [n for _, n in WORK]
    assert 0 in used and 3 in used, used


def test_tp2_adaptive_runs_rank_0s_gamma(spec_ckpt):
    """Under --tp 2 (gloo ranks) every step's gamma is rank 0's, broadcast: the ranks finish in
    lockstep with tp 1's tokens."""
    import json
    import os
    import subprocess
    import sys

    folder, _ = spec_ckpt
    args = ["generate", "--model", str(folder), "--prompt-ids", "3,17,99,4,250,6,7,8", "--gamma", "3",
            "--gamma-policy", "adaptive", "--max-new-tokens", "12", "--ignore-eos", "--json", "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    two = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", *args, "--tp", "2"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert two.returncode == 0, two.stderr
    # the baseline: gamma 0 (the adaptive policy with --gamma 0 is refused: nothing to choose from)
    base_args = ["fixed" if a == "adaptive" else "0" if i == args.index("--gamma") + 1 else a for i, a in enumerate(args)]
    base = subprocess.run([sys.executable, "-m", "glm5mtp_cli.cli", *base_args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert base.returncode == 0, base.stderr
    doc = json.loads(two.stdout)
    assert doc["tp"] == 2 and doc["gamma_policy"] == "adaptive"
    assert doc["requests"][0]["tokens"] == json.loads(base.stdout)["requests"][0]["tokens"]


def test_drafter_catch_up_after_steps_without_drafts_is_not_charged_to_a_gamma(glm5, monkeypatch):
    """Rows left by steps at gamma 0 reach the drafter before the drafting step's clock starts:
    a catch-up made 0.3 s slower shows in no measured step cost (the first version charged it to
    the probe, which kept drafting off)."""
    import time

    engine, pools = _make("glm5", glm5, 3, 1)
    used, measured = _adaptive(engine, probe_every=6)  # 5 steps off: 6 pending rows, 2 over gamma + 1
    calls = []
    real = engine.head.append_rows

    def slow(*args):
        calls.append(len(used))
        time.sleep(0.3)
        return real(*args)

    monkeypatch.setattr(engine.head, "append_rows", slow)
    _run(engine, pools, 1, work=[(list(range(10, 40)), 16)])
    assert any(n > 0 for n in calls), calls  # a catch-up ran between steps (not only at the prefill)
    drafted = [sec for g, sec in measured if g]
    assert drafted and max(drafted) < 0.3, measured
