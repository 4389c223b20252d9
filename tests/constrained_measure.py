"""Constrained against unconstrained speculation on one loaded model, in turns within one process:
mean acceptance length and decode step time per (batch size, mode), mode one of unconstrained,
masked (the drafter masked too) and unmasked (--no-draft-mask: only the verify masked), every
complete output checked. Prints one JSON document (profiles/constrained/RESULTS.md reads it).

Step time: each engine step's wall time (SpecEngine.step, which ends in the step's host read, so
the device has finished it) less the admission it ran (prefill, graph capture), the median over the
steps that ran with every slot full. Constrained replies are shorter than free ones, so a run's mean
step (decode time / steps) mixes in more half-empty steps of admission and tails; full steps compare
like with like. Grammar host time:
the wall time of the step's grammar work (masks filled, copied and applied, matchers walked and
committed, finished outputs validated) per step; on the CPU the masks' application is host work too, on CUDA the drafts'
host read inside it also waits for the device.

    python3 tests/constrained_measure.py --model glm5-nano --device cpu --threads 1 > out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "profiles" / "constrained"  # the prompts and the results
sys.path.insert(0, str(ROOT))

from glm5mtp_cli.engine.config import EngineConfig, ModelSpec  # noqa: E402
from glm5mtp_cli.engine.run import run_generate  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime, set_threads  # noqa: E402
import glm5mtp_cli.engine.speculate as speculate  # noqa: E402
from glm5mtp_cli.engine.grammar import Grammars, SeqGrammar, StepMasks  # noqa: E402
from glm5mtp_cli.engine.graphs import ForwardRunner  # noqa: E402
from glm5mtp_cli.engine.speculate import SpecEngine  # noqa: E402
from glm5mtp_cli.prompts import encode_prompts, read_file  # noqa: E402

MODES = ("unconstrained", "masked", "unmasked")
STEPS: list[tuple[int, float]] = []  # (active sequences, seconds) of every engine step


ACTIVE = [0]  # the sequences the current step runs (its schedule's)


def _timed_step(step):
    """The step's wall time less its admission (prefill and graph capture): a step that seats a
    prompt would otherwise count that prompt's prefill as decode, and constrained replies, being
    short, turn slots over in more of the full steps."""
    def timed(self, run):
        ACTIVE[0] = 0
        admission = run.prefill_s + run.capture_s
        t0 = time.perf_counter()
        step(self, run)
        if ACTIVE[0]:
            STEPS.append((ACTIVE[0], time.perf_counter() - t0 - (run.prefill_s + run.capture_s - admission)))
    return timed


def _counted_schedule(schedule):
    def counted(self, run):
        active = schedule(self, run)
        ACTIVE[0] = len(active)
        return active
    return counted


SpecEngine.step = _timed_step(SpecEngine.step)
SpecEngine._schedule = _counted_schedule(SpecEngine._schedule)
HOST = [0.0]  # seconds of grammar work in the current run
PARTS: dict[str, float] = {}  # the same by part (wait: the waits for the drafts' copies, inside draft and verify)


def _host(fn, part: str, total: bool = True):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            HOST[0] += dt if total else 0.0
            PARTS[part] = PARTS.get(part, 0.0) + dt
    return timed


SpecEngine._masks = _host(SpecEngine._masks, "masks")
StepMasks.draft, StepMasks.verify = _host(StepMasks.draft, "draft"), _host(StepMasks.verify, "verify")
StepMasks._read = _host(StepMasks._read, "wait", total=False)
SeqGrammar.commit = _host(SeqGrammar.commit, "commit")
Grammars.validates = _host(Grammars.validates, "validate")  # a finished sequence's check, inside its last step
speculate.apply_bitmask = _host(speculate.apply_bitmask, "apply")  # an admission's first masks
ForwardRunner.mask = _host(ForwardRunner.mask, "apply")  # a step's: copied and applied (a masked verdict's replay)


def one(rt, ids, rules, mode: str, batch: int, gamma: int, max_new: int) -> dict:
    config = EngineConfig(gamma=gamma, batch_size=batch, max_new_tokens=max_new, draft_mask=mode != "unmasked")
    t0 = time.perf_counter()
    STEPS.clear()
    HOST[0] = 0.0
    PARTS.clear()
    results, acc, lat, _, _ = run_generate(rt, ids, config, constraints=None if mode == "unconstrained" else rules)
    steps = sum(lat["gamma_steps"].values())
    mine = [r for r in results if r.constraint is not None]
    full = [s for n, s in STEPS if n == batch]
    return {"grammar_host_ms_per_step": 1e3 * HOST[0] / len(STEPS),
            "grammar_host_ms_per_step_by_part": {k: 1e3 * v / len(STEPS) for k, v in PARTS.items()}, "full_steps": len(full), "full_step_ms": 1e3 * statistics.median(full) if full else None,"mode": mode, "batch": batch, "gamma": gamma, "steps": steps, "wall_s": time.perf_counter() - t0,
            "decode_s": lat["wall_decode_s"], "step_ms": 1e3 * lat["wall_decode_s"] / steps,
            "tokens": sum(len(r.tokens) for r in results), "decode_tokens_per_s": lat["decode_tokens_per_s"],
            "mean_acceptance_length": acc.to_json()["mean_acceptance_length"],
            "requests": len(results),
            "complete": sum(bool(r.complete) for r in mine), "valid": sum(bool(r.valid) for r in mine),
            "constrained": len(mine), "tokens_per_request": [r.tokens for r in results],
            "finish": [r.finish_reason for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm5-nano")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", default=str(HERE / "prompts.jsonl"))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-slot", type=int, default=5,
                    help="requests per slot at least (the prompts repeated): a batch's steps run mostly full")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    set_threads(a.threads if a.device == "cpu" else None)
    rt = load_runtime(ModelSpec(a.model, a.device), progress=False)
    items = read_file(Path(a.prompts))
    ids = encode_prompts(items, rt.tokenizer, folder=rt.resolved.folder)
    rules = [p.constraint for p in items]
    runs = []
    with torch.no_grad():
        for batch in map(int, a.batch_sizes.split(",")):
            copies = -(-a.per_slot * batch // len(ids))
            work, work_rules = ids * copies, rules * copies
            for mode in MODES:  # a warm-up of each, then the timed repeats in turns
                one(rt, work, work_rules, mode, batch, a.gamma, a.max_new_tokens)
            for _ in range(a.repeats):
                for mode in MODES:
                    runs.append(one(rt, work, work_rules, mode, batch, a.gamma, a.max_new_tokens))
                    row = {k: v for k, v in runs[-1].items() if k not in ("tokens_per_request", "finish")}
                    print(json.dumps(row), file=sys.stderr, flush=True)  # what a timeout leaves behind
            g0 = one(rt, work, work_rules, "masked", batch, 0, a.max_new_tokens)  # constrained target alone
            for r in runs:
                if r["batch"] == batch and r["mode"] != "unconstrained":
                    r["same_tokens_as_constrained_gamma0"] = r["tokens_per_request"] == g0["tokens_per_request"]
    summary = []
    for batch in map(int, a.batch_sizes.split(",")):
        base = None
        for mode in MODES:
            mine = [r for r in runs if r["batch"] == batch and r["mode"] == mode]
            row = {"batch": batch, "mode": mode, "full_step_ms": statistics.median(r["full_step_ms"] for r in mine),
                   "full_steps": sum(r["full_steps"] for r in mine),
                   "grammar_host_ms_per_step": statistics.median(r["grammar_host_ms_per_step"] for r in mine),
                   "step_ms_median": statistics.median(r["step_ms"] for r in mine),
                   "decode_tokens_per_s_median": statistics.median(r["decode_tokens_per_s"] for r in mine),
                   "mean_acceptance_length": mine[0]["mean_acceptance_length"],
                   "complete": mine[0]["complete"], "valid": mine[0]["valid"], "constrained": mine[0]["constrained"],
                   "same_tokens_as_constrained_gamma0": mine[0].get("same_tokens_as_constrained_gamma0")}
            base = base or row
            row["full_step_vs_unconstrained"] = row["full_step_ms"] / base["full_step_ms"]
            row["tokens_per_s_vs_unconstrained"] = row["decode_tokens_per_s_median"] / base["decode_tokens_per_s_median"]
            summary.append(row)
    for r in runs:
        del r["tokens_per_request"]
    print(json.dumps({"command": " ".join(["python3", "tests/constrained_measure.py"] + sys.argv[1:]),
                      "commit": commit, "model": a.model, "device": str(rt.device), "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
