"""Where a warm engine's admissions go: one engine runs the workload (HumanEval prompts, or any JSONL
of {"prompt": ...}) four times. Run 0 warms it (every graph captured); run 1 times each part of the
admissions synced (the whole phase, `admit`: reserving and prefilling, `_fill`: the prefills and the
first tokens, the target and drafter prefills, seating in the decode graphs); run 2 is cProfiled
unsynced, as it runs (cumulative, then by own time); run 3 runs plain. Syncing moves time between
parts (it stops host and device overlapping), so read run 1 for shares and run 3 for the total.

    python3 tests/admission_breakdown.py --model glm5next-nano --prompts humaneval164.jsonl --gamma 3 --batch-size 8
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import glm5mtp_cli.engine.speculate as speculate  # noqa: E402
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec  # noqa: E402
from glm5mtp_cli.engine.runtime import load_runtime, make_engine, resolve  # noqa: E402
from glm5mtp_cli.engine.sequence import Request, reserve_tokens  # noqa: E402

MODE = ["plain"]  # what the current run does: plain, synced or profiled
WALL: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def synced(owner, name: str, sync) -> None:
    """owner.name timed synced in the synced run."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        if MODE[0] != "synced":
            return fn(*args, **kwargs)
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            WALL[name] += time.perf_counter() - t0
            CALLS[name] += 1

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm5next-nano")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--device", default="cuda", help="cuda (prefill graphs), or cpu to try the script")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rt = load_runtime(ModelSpec(a.model, a.device), progress=False)
    prompts = [rt.tokenizer.encode(json.loads(line)["prompt"]) for line in open(a.prompts)]
    config = resolve(rt, EngineConfig(gamma=a.gamma, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                                      prefill_graphs=cuda))
    per_seq = max(reserve_tokens(len(p), a.max_new_tokens, a.gamma, config.alloc, config.max_seq_len) for p in prompts)
    engine = make_engine(rt, rt.make_pools(per_seq, a.batch_size, prefill_graphs=cuda), config)
    for owner, name in [(speculate.SpecEngine, "_admit_into"), (speculate.SpecEngine, "admit"),
                        (speculate.SpecEngine, "_fill"), (speculate, "prefill_targets"),
                        (speculate, "prefill_drafters"), (speculate.SpecEngine, "_seat")]:
        synced(owner, name, sync)
    profile = cProfile.Profile()
    admit = speculate.SpecEngine._admit_into

    def profiled(self, run, free):
        if MODE[0] != "profiled":
            return admit(self, run, free)
        profile.enable()
        try:
            return admit(self, run, free)
        finally:
            profile.disable()

    speculate.SpecEngine._admit_into = profiled
    for i, mode in enumerate(["plain", "synced", "profiled", "plain"]):
        MODE[0] = mode
        p0, d0, n0 = engine.wall_prefill_s, engine.wall_decode_s, engine.admissions
        with torch.no_grad():
            results = engine.generate([Request(p, a.max_new_tokens, j) for j, p in enumerate(prompts)])
        prefill, decode = engine.wall_prefill_s - p0, engine.wall_decode_s - d0
        row = {"model": a.model, "gamma": a.gamma, "batch": a.batch_size, "run": i, "mode": mode,
               "prefill_s": round(prefill, 4), "decode_s": round(decode, 4), "admissions": engine.admissions - n0,
               "e2e_tokens_per_s": round(sum(len(r.tokens) for r in results) / (prefill + decode), 1)}
        if mode == "synced":
            row["parts_s_calls"] = {k: [round(v, 4), CALLS[k]] for k, v in WALL.items()}
        print(json.dumps(row), flush=True)
    engine.close()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
