"""The project's one speedup model, and bench's gamma recommendation built on it: decode tokens/s
predicted for every gamma from what one bench measured (`plan` feeds the same model step costs it
predicts from the hardware instead: diagnostics/plan.py).

A decode step with g drafts over `slots` sequences emits slots * E(g) tokens in C(g) seconds, so it
decodes at slots * E(g) / C(g) tokens/s, where

- E(g) = 1 + p_1 + ... + p_g (engine/gamma.py's expected_tokens), p_k the measured per-position
  acceptance (metrics.Acceptance: the share of steps whose first k drafts were all accepted) of the
  largest gamma measured at that batch size, so gammas up to it are predicted;
- C(g) = verify + g * draft, the line fitted (least squares; exact through two points) to the
  measured steps, each measured step's cost being slots * its mean acceptance length / its decode
  tokens/s: the wall time per step that the measured decode tokens/s implies, host work between the
  steps included (the engine's per-step event times leave that out, so they would not predict the
  measured column).

Decode only: end to end adds the prefill, which gamma does not change (but for the drafter's).
Only fixed-gamma rows are used: an adaptive row's steps mix gammas, so its cost is no point of C.

The recommendation is the gamma whose run decoded fastest, as the table shows it: the model smooths
the measured costs (a line through them), so on a noisy machine its pick can be a gamma that measured
slower (at batch 8 on a loaded CPU it picked gamma 0 beside a table whose best was gamma 4). The
model's pick is reported beside it, and where it is a gamma not run, as one to measure.

A row's own prediction (its `predicted_decode_tokens_per_s`) holds that row out: the line through
the other gammas' costs and the acceptance of the largest other, so it predicts what the fit did not
see; with two gammas run each has a single other and nothing is predicted (a line through two points
is exact, so it would only echo the measurement).
"""

from __future__ import annotations

from glm5mtp_cli.engine.gamma import expected_tokens
from glm5mtp_cli.engine.synthetic import conditional


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (gamma, seconds per step); >= 2 gammas."""
    n = len(points)
    mx = sum(points) / n
    my = sum(points.values()) / n
    slope = sum((g - mx) * (c - my) for g, c in points.items()) / sum((g - mx) ** 2 for g in points)
    return my - slope * mx, slope


def decode_tokens_per_s(rates: list[float], gamma: int, step_s: float, slots: int) -> float:
    """The speedup model: `slots` sequences each emit E(gamma) tokens per step of `step_s` seconds;
    `rates` are conditional (engine/synthetic.conditional converts acceptance's cumulative ones)."""
    return slots * expected_tokens(rates, gamma) / step_s


def best_gamma(by_gamma: list[float]) -> int:
    """The gamma (list index) with the most tokens/s; the smallest on a tie."""
    return max(range(len(by_gamma)), key=by_gamma.__getitem__)


def predict(per_position: list[float], verify: float, draft: float, slots: int) -> list[float]:
    """Decode tokens/s for gamma 0..len(per_position) (list index = gamma) from the per-position
    acceptance and the step cost line (seconds)."""
    rates = conditional(per_position)
    return [decode_tokens_per_s(rates, g, verify + g * draft, slots) for g in range(len(per_position) + 1)]


def rates_for(conditional_rates: list[float], gamma: int) -> list[float]:
    """Conditional rates for positions 1..gamma: positions past the list take its last value (the rule
    engine/synthetic applies to --synthetic-acceptance; plan's too)."""
    if not conditional_rates:
        return [0.0] * gamma
    return [conditional_rates[min(k, len(conditional_rates) - 1)] for k in range(gamma)]


def held_out(measured: dict[int, dict], costs: dict[int, float], gamma: int, slots: int) -> float | None:
    """Decode tokens/s of the run at `gamma` predicted without it (module docstring): None with fewer
    than two other gammas."""
    others = {g: c for g, c in costs.items() if g != gamma}
    if len(others) < 2:
        return None
    verify, draft = fit_line(others)
    rates = rates_for(conditional(measured[max(others)]["per_position"]), gamma)
    return decode_tokens_per_s(rates, gamma, verify + gamma * draft, slots)


def recommend(rows: list[dict]) -> list[dict]:
    """One recommendation per batch size that has a gamma-0 row and a fixed gamma > 0 row (else none):
    best_gamma, the measured best; model_best_gamma, the model's pick (module docstring). Sets each
    row's predicted_decode_tokens_per_s (held_out; None where nothing is predicted)."""
    out = []
    for r in rows:
        r["predicted_decode_tokens_per_s"] = None
    for batch in dict.fromkeys(r["batch"] for r in rows):
        measured = {r["gamma"]: r for r in rows
                    if r["batch"] == batch and r["gamma"] is not None and r["decode_tokens_per_s"]
                    and (r["gamma"] == 0 or r["gamma_policy"] == "fixed")}
        if 0 not in measured or len(measured) < 2:
            continue
        top = measured[max(measured)]
        slots = min(batch, top["prompts"])  # sequences decoding together (fewer prompts than slots: fewer)
        costs = {g: slots * r["mean_acceptance_length"] / r["decode_tokens_per_s"] for g, r in measured.items()}
        verify, draft = fit_line(costs)
        by_gamma = predict(top["per_position"], verify, draft, slots)
        for g, r in measured.items():
            r["predicted_decode_tokens_per_s"] = held_out(measured, costs, g, slots)
        best = max(measured, key=lambda g: (measured[g]["decode_tokens_per_s"], -g))  # the smallest on a tie
        model_best = best_gamma(by_gamma)
        out.append({"batch": batch, "best_gamma": best, "predicted_tokens_per_s": by_gamma[best],
                    "measured_tokens_per_s": measured[best]["decode_tokens_per_s"],
                    "model_best_gamma": model_best, "model_best_tokens_per_s": by_gamma[model_best],
                    "model_best_measured_tokens_per_s": (measured[model_best]["decode_tokens_per_s"]
                                                         if model_best in measured else None),
                    "by_gamma": by_gamma, "verify_ms": verify * 1e3, "draft_ms": draft * 1e3})
    return out
