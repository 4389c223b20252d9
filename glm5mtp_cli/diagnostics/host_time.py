"""The engine's host time per decode step, forwards excluded: what the step loop costs beside its
graph replays (at batch 64 on the H200 the loop's host work was a large share of a step).

    OMP_NUM_THREADS=1 python3 -m glm5mtp_cli.diagnostics.host_time --gamma 3 --batch 64 [--model glm5next-tiny]

Runs glm5-tiny (or --model, another profile) with random weights on the CPU in static mode (the CUDA-graph code path, its forwards
run eagerly), times every static forward and subtracts them from the decode wall time; prints the
best of `--repeats` runs after a warm-up, per step and per sequence-step. A measurement of Python
bookkeeping on this machine, not of any GPU.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from glm5mtp_cli.engine import static
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec
from glm5mtp_cli.engine.runtime import load_runtime, make_engine
from glm5mtp_cli.engine.sequence import Request


def host_us_per_step(gamma: int, batch: int, requests: int = 256, new_tokens: int = 64, repeats: int = 3,
                     model: str = "glm5-tiny") -> float:
    rt = load_runtime(ModelSpec(model, "cpu", "fp32", random_weights=True), progress=False)
    pools = rt.make_pools(200, batch + 1)
    engine = make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=256, eos_ids=(), graphs="static"))
    rnd = random.Random(0)
    reqs = [Request([rnd.randrange(rt.cfg.vocab_size) for _ in range(rnd.randrange(20, 60))], new_tokens, i)
            for i in range(requests)]
    spent, steps = [0.0], [0]
    run, step = static.StaticForward.run, engine.step

    def timed_run(f):
        t0 = time.perf_counter()
        out = run(f)
        spent[0] += time.perf_counter() - t0
        return out

    commit, stepping = rt.target.commit, [False]

    def timed_commit(pending, kept):
        # a fixed-size state's commit after a verify: a graph replay on CUDA (StaticCommit), eager
        # compute here, so it is a forward too; admissions' commits fall outside the decode wall
        t0 = time.perf_counter()
        commit(pending, kept)
        if stepping[0]:
            spent[0] += time.perf_counter() - t0

    def counted_step(schedule):
        steps[0] += 1
        stepping[0] = True
        try:
            return step(schedule)
        finally:
            stepping[0] = False

    static.StaticForward.run, engine.step, rt.target.commit = timed_run, counted_step, timed_commit
    try:
        engine.generate(reqs, batch_size=batch)  # warm-up: builds the static forwards
        best = None
        for _ in range(repeats):
            spent[0], steps[0], decode0 = 0.0, 0, engine.wall_decode_s
            engine.generate(reqs, batch_size=batch)
            host = (engine.wall_decode_s - decode0 - spent[0]) / steps[0]
            best = host if best is None else min(best, host)
        return best * 1e6
    finally:
        static.StaticForward.run = run
        del rt.target.commit
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--model", default="glm5-tiny", help="a profile, run with random weights (glm5next-tiny: GLM-5-Next)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    us = host_us_per_step(a.gamma, a.batch, a.requests, repeats=a.repeats, model=a.model)
    print(f"{a.model}, gamma {a.gamma}, batch {a.batch}: {us:.0f} us of host time per step, {us / a.batch:.1f} us per "
          f"sequence-step (best of {a.repeats}, forwards excluded)")


if __name__ == "__main__":
    main()
