"""bench's gamma recommendation (diagnostics/recommend.py) on synthetic numbers computed by hand."""

from __future__ import annotations

import pytest

from glm5mtp_cli.diagnostics.recommend import fit_line, predict, recommend
from glm5mtp_cli.engine.synthetic import conditional as conditional_rates

# per-position acceptance [0.9, 0.8, 0.7]: E(g) = 1, 1.9, 2.7, 3.4
PER_POSITION = [0.9, 0.8, 0.7]


def _row(batch, gamma, mal, step_s, slots=None):
    """A bench row whose decode tokens/s is what `slots` sequences emit at `mal` tokens per step_s."""
    slots = slots or batch
    return {"batch": batch, "gamma": gamma, "gamma_policy": "fixed", "prompts": slots, "mean_acceptance_length": mal,
            "decode_tokens_per_s": slots * mal / step_s, "per_position": PER_POSITION[:gamma]}


def test_drafting_pays_at_batch_1():
    """verify 1 ms + 0.1 ms per extra row, draft 0.3 ms: a step with g drafts costs 1 + 0.4 g ms, so
    tokens/s = 1000 E(g) / (1 + 0.4 g) = 1000, 1357.1, 1500, 1545.5: gamma 3 wins."""
    assert conditional_rates(PER_POSITION) == pytest.approx([0.9, 0.8 / 0.9, 0.7 / 0.8])
    verify, draft = fit_line({0: 1e-3, 3: 2.2e-3})
    assert (verify, draft) == pytest.approx((1e-3, 0.4e-3))
    assert predict(PER_POSITION, verify, draft, 1) == pytest.approx([1000, 1900 / 1.4, 2700 / 1.8, 3400 / 2.2])
    rows = [_row(1, 0, 1.0, 1e-3), _row(1, 3, 3.4, 2.2e-3)]
    (rec,) = recommend(rows)
    assert rec["batch"] == 1 and rec["best_gamma"] == 3 == rec["model_best_gamma"]
    assert rec["predicted_tokens_per_s"] == pytest.approx(3400 / 2.2) == rec["measured_tokens_per_s"]
    assert rec["verify_ms"] == pytest.approx(1.0) and rec["draft_ms"] == pytest.approx(0.4)
    # two gammas: each row's only other run cannot draw a line, so no row is predicted (it would echo itself)
    assert [r["predicted_decode_tokens_per_s"] for r in rows] == [None, None]


def test_drafting_does_not_pay_at_batch_8():
    """verify 1 ms + 1 ms per extra row, draft 0.3 ms (1 + 1.3 g ms), 8 slots: 8000 E(g) / (1 + 1.3 g)
    = 8000, 6608.7, 6000, 5551.0 tokens/s: gamma 0 wins, and gamma 1 (not measured) is predicted."""
    rows = [_row(8, 0, 1.0, 1e-3), _row(8, 3, 3.4, 4.9e-3)]
    (rec,) = recommend(rows)
    assert rec["best_gamma"] == 0 == rec["model_best_gamma"] and rec["predicted_tokens_per_s"] == pytest.approx(8000)
    assert rec["by_gamma"] == pytest.approx([8000, 8 * 1900 / 2.3, 8 * 2700 / 3.6, 8 * 3400 / 4.9])


def test_unmeasured_best_and_a_fitted_line():
    """Three measured gammas (0, 1, 3 at 1, 1.5, 1.8 ms): the cost line is the least-squares fit, by hand
    mean gamma 4/3, mean cost 4.3/3 ms, slope (7/6) / (42/9) = 0.25 ms, intercept 1.1 ms; E(g) = 1, 1.9,
    2.7, 2.8 over 1.1, 1.35, 1.6, 1.85 ms: the best gamma (2) need not have been measured."""
    rows = [_row(1, 0, 1.0, 1.0e-3), _row(1, 1, 1.9, 1.5e-3), _row(1, 3, 2.8, 1.8e-3)]
    rows[2]["per_position"] = [0.9, 0.8, 0.1]  # the third draft is rarely accepted: E(3) = 2.8
    (rec,) = recommend(rows)
    verify, draft = 1.1e-3, 0.25e-3
    assert rec["verify_ms"] == pytest.approx(verify * 1e3) and rec["draft_ms"] == pytest.approx(draft * 1e3)
    want = [e / (verify + g * draft) for g, e in enumerate([1.0, 1.9, 2.7, 2.8])]
    assert rec["by_gamma"] == pytest.approx(want)
    # the model's pick was not run: the recommendation is the fastest run (gamma 3: 2.8 / 1.8 ms)
    assert rec["model_best_gamma"] == 2 and rec["model_best_measured_tokens_per_s"] is None
    assert rec["best_gamma"] == 3 and rec["measured_tokens_per_s"] == pytest.approx(2.8 / 1.8e-3)
    # each row held out: the line through the other two costs, the acceptance of the largest other
    # (gamma 3 from gamma 1's: 0.9 at every position, E(3) = 1 + 0.9 + 0.81 + 0.729)
    assert [r["predicted_decode_tokens_per_s"] for r in rows] == pytest.approx(
        [1 / 1.35e-3, 1.9 / (1e-3 + 0.8e-3 / 3), 3.439 / 2.5e-3])


def test_the_recommendation_follows_the_table_where_the_model_picks_a_slower_run():
    """A noisy machine (issue 70: gamma 0 recommended at batch 8 beside a table whose best was gamma 4):
    gammas 0..4 cost 1, 3, 5, 7, 3.5 ms, so gamma 4 decodes fastest, but the line through the costs
    (2.1 + 0.9 g ms) makes the model pick gamma 3."""
    per_position = [0.9, 0.8, 0.7, 0.6]
    rows = [_row(1, g, 1 + sum(per_position[:g]), ms * 1e-3) for g, ms in enumerate((1, 3, 5, 7, 3.5))]
    for r in rows:
        r["per_position"] = per_position[:r["gamma"]]
    (rec,) = recommend(rows)
    assert rec["verify_ms"] == pytest.approx(2.1) and rec["draft_ms"] == pytest.approx(0.9)
    assert rec["model_best_gamma"] == 3 and rec["model_best_measured_tokens_per_s"] == pytest.approx(3.4 / 7e-3)
    assert rec["best_gamma"] == 4 and rec["measured_tokens_per_s"] == pytest.approx(4.0 / 3.5e-3)
    assert rec["predicted_tokens_per_s"] == pytest.approx(4.0 / 5.7e-3)


def test_no_recommendation_without_gamma0_or_a_fixed_gamma():
    adaptive = _row(1, 3, 3.4, 2.2e-3)
    adaptive["gamma_policy"] = "adaptive"  # its steps mix gammas: no point of the cost line
    transformers = {"batch": 1, "gamma": None, "decode_tokens_per_s": None}
    rows = [transformers, _row(1, 0, 1.0, 1e-3), adaptive, _row(2, 3, 3.4, 2.2e-3, slots=2)]
    assert recommend(rows) == []
    assert [r["predicted_decode_tokens_per_s"] for r in rows] == [None] * 4
