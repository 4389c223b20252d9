"""`plan --calibrate`: the fit of diagnostics/calibration.py's values to measured runs, through the same
forwards `plan` predicts with (diagnostics/plan.forward), and `--check`: files the fit did not see,
predicted and set beside their measurements.

Each measurement's predicted time is linear in the unknowns once the bandwidth efficiencies are
held: sum over its forwards of (bytes + repeated expert bytes x the share of repeats that cost a first
read, held in [0, 1]) / (bandwidth x efficiency of the kind) + kernels x per-kernel cost (+ host per step + sequences x host per sequence for a run's step, + sequences x drafts x
draft cost per sequence where it drafts); so the fit alternates a
closed-form efficiency per kind with a linear least squares in the rest, each equation divided by
its measured time (relative errors: a 0.7 ms nano step weighs as a 2 ms GLM-5 one).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from glm5mtp_cli.diagnostics import calibration as cal_mod
from glm5mtp_cli.diagnostics.calibration import Calibration, Measurement
from glm5mtp_cli.diagnostics.hardware import Hardware
from glm5mtp_cli.diagnostics.plan import Forward, PlanConfig, forward, model_sizes, step_forwards

ROUNDS = 5000  # at most: the alternation converges slowly (50 rounds left the efficiencies ~5% off)
TOLERANCE = 1e-10  # stop when no value moves by more than this, relatively
START_KERNEL_S = 2.5e-6  # where the alternation starts (a graph-replayed kernel's order); the fit moves it


@lru_cache(maxsize=None)
def _config(model: str, layers: int | None, fp8: bool):
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.models.fp8 import fp8_config

    cfg, _ = resolve_config(model)
    if layers is not None:
        cfg = cfg.with_layers(layers)
    return fp8_config(cfg) if fp8 else cfg


def family_of_measurement(m: Measurement) -> str:
    return _config(m.model, None, False).model_type


def _forwards(m: Measurement, hw: Hardware, cal: Calibration) -> list[tuple[Forward, int]]:
    """(forward, times it runs) of one measurement, under `cal`."""
    c = PlanConfig(m.model, m.layers, m.fp8, None, (1.0,), "calibration", hw, cal, 1, m.context, m.context,
                   (m.seqs,), (m.gamma,))
    s = model_sizes(_config(m.model, m.layers, m.fp8), c)
    if m.kind != "run":
        return [(forward(m.kind, m.seqs, 1, s, c), 1)]
    return step_forwards(m.seqs, m.gamma, s, c)


def predict_seconds(m: Measurement, hw: Hardware, cal: Calibration) -> float:
    """What plan's model says the measurement took: a bench step is device time (no host term)."""
    fwds = _forwards(m, hw, cal)
    total = sum(n * f.seconds for f, n in fwds)
    return total if m.kind == "run" else total - sum(n * f.times["host"] for f, n in fwds)


def _terms(m: Measurement, hw: Hardware, cal: Calibration, keys: set[str]) -> dict:
    """The measurement's coefficients: bytes / bandwidth per efficiency key, kernels, host per step,
    per forward and per sequence (a bench step is device time: no host)."""
    fwds = _forwards(m, hw, cal)
    run = m.kind == "run"
    bw: dict[str, float] = {}
    reread: dict[str, float] = {}  # the repeated expert bytes (sizing.reread_experts_factor), per key too
    for f, n in fwds:
        key = cal_mod.efficiency_key(f.kind, m.fp8, keys)  # a run's forwards: draft, verify or decode
        bw[key] = bw.get(key, 0.0) + n * f.bytes / hw.memory_bytes_per_s
        reread[key] = reread.get(key, 0.0) + n * f.reread_bytes / hw.memory_bytes_per_s
    return {"bw": bw, "reread_bw": reread, "kernels": sum(n * f.kernels for f, n in fwds),
            "host_step": 1.0 if run else 0.0,
            "host_forward": float(sum(n for _, n in fwds)) if run else 0.0,
            "host_seqs": float(m.seqs) if run else 0.0,
            "draft_seqs": float(m.seqs * m.gamma) if run else 0.0}


def fit(measurements: list[Measurement], hw: Hardware, files: list[str]) -> Calibration:
    """The calibration that best predicts `measurements` (taken on `hw`)."""
    hw = dataclasses.replace(hw, launch_s=None)  # the per-kernel cost is fitted, not given
    kernels = cal_mod.kernel_counts(measurements, family_of_measurement)
    keys = {cal_mod.efficiency_key(m.kind, m.fp8, {"draft_fp8", "decode_fp8"})
            for m in measurements if m.kind != "run"} | {"draft", "decode"}
    cal = Calibration(hw.name, {k: 0.8 for k in keys}, START_KERNEL_S, 0.0, 0.0, cal_mod.HOST_SEQUENCE_PRIOR_S,
                      kernels)
    terms = [_terms(m, hw, cal, keys) for m in measurements]  # bytes and kernels do not depend on the fit
    y = np.array([m.seconds for m in measurements])
    runs = [m for m in measurements if m.kind == "run"]
    fit_host = len({m.gamma > 0 for m in runs}) == 2  # a run without drafts and one with: step vs forward
    fit_seqs = any(m.seqs > 1 for m in runs)
    # a drafting run at batch > 1 beside a decoding one at batch > 1: the per-sequence draft cost
    # is then told apart from the per-sequence step cost
    fit_draft = fit_seqs and any(m.seqs > 1 and m.gamma > 0 for m in runs) and any(
        m.seqs > 1 and m.gamma == 0 for m in runs)
    # repeated expert reads (the few-pair MoE kernels at more than one token): their share priced as
    # first reads, fitted when some measurement has them
    fit_reread = any(v > 0 for t in terms for v in t["reread_bw"].values())
    eff = dict(cal.bandwidth_efficiency)
    k, hs = cal.per_kernel_s, cal.host_sequence_s
    h = hf = ds = re = 0.0
    for _ in range(ROUNDS):
        before = [*eff.values(), k, h, hf, hs, ds, re]
        # the rest held: each efficiency from the single forwards that use it (closed form in 1/eff)
        for key in eff:
            rows = [(t, m) for t, m in zip(terms, measurements) if m.kind != "run" and key in t["bw"]]
            if rows:
                a = np.array([t["bw"][key] + re * t["reread_bw"].get(key, 0.0) for t, _ in rows])
                rest = np.array([m.seconds - t["kernels"] * k for t, m in rows])
                w = 1 / np.array([m.seconds for _, m in rows]) ** 2
                eff[key] = float(np.sum(w * a * a) / np.sum(w * a * rest))
        # then k and the host terms the runs identify, by linear least squares on relative errors
        bw = np.array([sum(v / eff[key] for key, v in t["bw"].items()) for t in terms])
        for t in terms:  # the repeats' column at these efficiencies
            t["reread"] = sum(v / eff[key] for key, v in t["reread_bw"].items())
        names = (["kernels"] + (["reread"] if fit_reread else []) + (["host_step", "host_forward"] if fit_host else []) + (["host_seqs"] if fit_seqs else [])
                 + (["draft_seqs"] if fit_draft else []))
        fixed = 0.0 if fit_seqs else np.array([t["host_seqs"] for t in terms]) * hs
        sol = _nonnegative_lstsq(terms, names, (y - bw - fixed) / y, y, {"reread": 1.0})
        k, h, hf, hs = sol["kernels"], sol.get("host_step", 0.0), sol.get("host_forward", 0.0), sol.get("host_seqs", hs)
        ds, re = sol.get("draft_seqs", 0.0), sol.get("reread", 0.0)
        after = [*eff.values(), k, h, hf, hs, ds, re]
        if all(abs(a - b) <= TOLERANCE * max(abs(b), 1e-12) for a, b in zip(after, before)):
            break
    out = Calibration(
        hw.name, eff, k, h, hf, hs, kernels, draft_sequence_s=ds, reread_fraction=re,
        fitted={"commit": cal_mod.head_commit(), "files": [cal_mod.file_record(f) for f in files],
                "host_sequence_s": "fitted" if fit_seqs else
                f"prior {cal_mod.HOST_SEQUENCE_PRIOR_S:g} s (no run given decodes more than one sequence)",
                "host_step_s": "fitted" if fit_host else "0: needs runs at gamma 0 and gamma > 0",
                "host_forward_s": "fitted" if fit_host else "0: needs runs at gamma 0 and gamma > 0",
                "draft_sequence_s": "fitted" if fit_draft else
                "0: needs runs at batch > 1 at gamma 0 and gamma > 0",
                "reread_fraction": ("fitted" if 0 < re < 1 else
                                    "fitted, held at 1: no dearer than a first read" if re >= 1 else
                                    "fitted, held at 0: free") if fit_reread else
                "0: no measurement runs the few-pair MoE kernels over more than one token",
                "compute_efficiency": "assumed, not fitted"})
    return dataclasses.replace(out, residuals=compare(measurements, hw, out))


def _nonnegative_lstsq(terms: list[dict], names: list[str], rhs, y, upper: dict | None = None) -> dict:
    """Least squares in `names` (columns: each term over measured time), a cost that comes out negative
    held at 0 and the rest refitted: no time is negative; likewise a value past its `upper` bound held
    there (the share of repeated reads that costs a first read is at most all of them)."""
    upper = upper or {}
    free, held = list(names), {}
    while True:
        col = lambda n: np.array([t[n] for t in terms]) / y  # noqa: E731
        rest = rhs - sum((col(n) * v for n, v in held.items()), np.zeros_like(rhs))
        sol = dict(zip(free, np.linalg.lstsq(np.stack([col(n) for n in free], 1), rest, rcond=None)[0].tolist())
                   if free else {})
        negative = [n for n in free if sol[n] < 0]
        over = [n for n in free if n in upper and sol[n] > upper[n]]
        if not negative and not over:
            return {n: sol.get(n, held.get(n, 0.0)) for n in names}
        if negative:
            n = min(negative, key=sol.__getitem__)
            held[n] = 0.0
        else:
            n = max(over, key=lambda n: sol[n] - upper[n])
            held[n] = upper[n]
        free.remove(n)


def compare(measurements: list[Measurement], hw: Hardware, cal: Calibration) -> list[dict]:
    """Each measurement beside plan's prediction of it."""
    hw = dataclasses.replace(hw, launch_s=None)  # the calibration's per-kernel cost
    out = []
    for m in measurements:
        p = predict_seconds(m, hw, cal)
        row = {"source": m.source, "what": m.what, "model": m.model, "measured_ms": m.seconds * 1e3,
               "predicted_ms": p * 1e3, "error": p / m.seconds - 1}
        if m.kind == "run":  # the run's decode tokens/s, measured and as predicted at its acceptance
            row |= {"measured_tokens_per_s": m.tokens_per_step / m.seconds,
                    "predicted_tokens_per_s": m.tokens_per_step / p}
        out.append(row)
    return out
