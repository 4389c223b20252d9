"""A warm engine's admissions: one engine runs the same workload (HumanEval prompts, or any JSONL of
{"prompt": ...}) several times, so that from the second run on every graph is already captured, as in
a server after its warm-up. Per run: prefill (the admission phases' wall), decode and capture seconds
and end-to-end tokens/s as `bench` counts them, and diagnostics.step_phases' rows (each step phase's
microseconds a step, and the admissions' target and drafter prefills, synced: a run whose capture
is not 0 has its captures inside those). The prefill less its prefills is the admission's own host
work (reserving, seating, first tokens). --profile: cProfile of the last run's admissions,
by cumulative time (the parts) and by own time.

    python3 tests/admission_measure.py --model glm5next-nano --prompts humaneval164.jsonl --gamma 3 --batch-size 64
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import glm5mtp_cli.engine.speculate as speculate  # noqa: E402
from glm5mtp_cli.diagnostics.step_phases import Phases, install  # noqa: E402
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime, make_engine, resolve  # noqa: E402
from glm5mtp_cli.engine.sequence import Request, reserve_tokens  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm5next-nano")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--device", default="cuda", help="cuda (prefill graphs), or cpu to try the script")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    rt = load_runtime(ModelSpec(a.model, a.device), progress=False)
    prompts = [rt.tokenizer.encode(json.loads(line)["prompt"]) for line in open(a.prompts)][: a.num_prompts]
    config = resolve(rt, EngineConfig(gamma=a.gamma, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                                      prefill_graphs=cuda))
    per_seq = max(reserve_tokens(len(p), a.max_new_tokens, a.gamma, config.alloc, config.max_seq_len) for p in prompts)
    engine = make_engine(rt, rt.make_pools(per_seq, a.batch_size, prefill_graphs=cuda), config)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    profile = cProfile.Profile()
    admit = speculate.SpecEngine._admit_into

    def profiled(self, run, free):
        profile.enable()
        try:
            return admit(self, run, free)
        finally:
            profile.disable()

    for i in range(a.runs):
        if a.profile and i == a.runs - 1:
            speculate.SpecEngine._admit_into = profiled
        phases = Phases()
        saved = install(phases, sync)
        p0, d0, c0 = engine.wall_prefill_s, engine.wall_decode_s, engine.wall_capture_s
        try:
            with torch.no_grad():
                results = engine.generate([Request(p, a.max_new_tokens, j) for j, p in enumerate(prompts)])
        finally:
            for owner, name, fn in reversed(saved):
                setattr(owner, name, fn)
        prefill, decode = engine.wall_prefill_s - p0, engine.wall_decode_s - d0
        print(json.dumps({"model": a.model, "gamma": a.gamma, "batch": a.batch_size, "run": i, "prefill_s": prefill,
                          "decode_s": decode, "capture_s": engine.wall_capture_s - c0,
                          "e2e_tokens_per_s": sum(len(r.tokens) for r in results) / (prefill + decode),
                          "phases": phases.rows()}), flush=True)
    engine.close()
    if a.profile:
        stats = pstats.Stats(profile, stream=sys.stderr)
        stats.sort_stats("cumulative").print_stats(45)  # by part: table writes, first-token wait, seating
        stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
