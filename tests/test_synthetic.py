"""--synthetic-acceptance: verify decisions drawn at given conditional rates (engine/synthetic.py);
the measured rates and mean acceptance length match the requested ones within sampling error; a
synthetic rejection emits the target's own token; every output says synthetic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.cli import app
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec, SamplingParams
from glm5mtp_cli.engine.run import run_generate
from glm5mtp_cli.engine.runtime import load_runtime
from glm5mtp_cli.engine.synthetic import conditional, cumulative, expected_acceptance_length, parse_rates
from glm5mtp_cli.errors import UserError

RATES = (0.9, 0.6, 0.3)


@pytest.fixture(scope="module")
def rt():
    return load_runtime(ModelSpec("glm5-tiny", "cpu", "fp32", random_weights=True), progress=False)


def _run(rt, rates, gamma=3, tokens=600, sampling=SamplingParams()):
    return run_generate(rt, [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]],
                        EngineConfig(gamma=gamma, max_new_tokens=tokens, batch_size=4, synthetic_acceptance=rates,
                                     eos_ids=(), sampling=sampling))


def test_cumulative_and_conditional_are_inverse():
    assert cumulative([0.9, 0.5, 0.2]) == pytest.approx([0.9, 0.45, 0.09])
    assert conditional(cumulative([0.9, 0.5, 0.2])) == pytest.approx([0.9, 0.5, 0.2])
    assert expected_acceptance_length((0.5,), 2) == pytest.approx(1 + 0.5 + 0.25)  # the last rate repeats


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)])
def test_measured_rates_match_the_requested_ones(rt, sampling):
    _, acc, _, _, _ = _run(rt, RATES, sampling=sampling)
    per = acc.to_json()["per_position"]
    reached = [acc.steps] + [round(c * acc.steps) for c in per[:-1]]  # steps that drew position k
    for k, (p, got, n) in enumerate(zip(RATES, conditional(per), reached)):
        assert abs(got - p) <= 4 * math.sqrt(p * (1 - p) / n), (k, got, p, n)
    mal, want = acc.mean_acceptance_length, expected_acceptance_length(RATES, 3)
    assert abs(mal - want) <= 4 * math.sqrt(2.0 / acc.steps), (mal, want)  # the length's variance is below 2


def test_a_synthetic_rejection_emits_the_targets_own_token(rt):
    """At rate 0 every draft is rejected: each step emits the target's token after the newest, so the
    output is exactly gamma 0's."""
    synthetic, _, _, _, _ = _run(rt, (0.0,), tokens=40)
    plain, _, _, _, _ = _run(rt, None, gamma=0, tokens=40)
    assert [r.tokens for r in synthetic] == [r.tokens for r in plain]
    assert all(r.acceptance.accepted == 0 and r.acceptance.proposed > 0 for r in synthetic)


@pytest.mark.parametrize("text", ["1.5", "a,b", ""])
def test_bad_rates_are_one_line(text):
    with pytest.raises(UserError, match="--synthetic-acceptance"):
        parse_rates(text)


def test_outputs_say_synthetic_and_compare_is_refused():
    runner = CliRunner()
    r = runner.invoke(app, ["generate", "--model", "glm5-tiny", "--random-weights", "--prompt-ids", "1,2,3",
                            "--max-new-tokens", "8", "--synthetic-acceptance", "0.7", "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["synthetic_acceptance"] == [0.7]
    r = runner.invoke(app, ["generate", "--model", "glm5-tiny", "--random-weights", "--prompt-ids", "1,2,3",
                            "--max-new-tokens", "8", "--synthetic-acceptance", "0.7", "--device", "cpu"])
    assert r.exit_code == 0 and "SYNTHETIC" in r.output and "not lossless" in r.output, r.output
    r = runner.invoke(app, ["generate", "--prompt-ids", "1,2", "--synthetic-acceptance", "0.7", "--compare"])
    assert r.exit_code == 2 and "--compare" in r.stderr


def test_leak_check_runs_clean_under_synthetic_acceptance():
    r = CliRunner().invoke(app, ["leak-check", "--model", "glm5-tiny", "--random-weights", "--sequences", "8",
                                 "--batch-size", "2", "--synthetic-acceptance", "0.8,0.4", "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and doc["synthetic_acceptance"] == [0.8, 0.4]
