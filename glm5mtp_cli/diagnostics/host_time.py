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

from glm5mtp_cli.engine.config import EngineConfig, ModelSpec
from glm5mtp_cli.engine.hooks import observing
from glm5mtp_cli.engine.runtime import load_runtime, make_engine
from glm5mtp_cli.engine.sequence import Request


class Forwards:
    """An observer (engine/hooks.py) of the static forwards and commits run inside steps: their seconds,
    and the steps. A fixed-size state's commit after a verify is a graph replay on CUDA
    (static.commit), eager compute here, so it counts as a forward too."""

    def __init__(self):
        self.spent, self.steps, self.stepping = 0.0, 0, False

    def wrap(self, obj, phase: str, fn):
        if phase == "step":
            def step(run):
                self.steps += 1
                self.stepping = True
                try:
                    return fn(run)
                finally:
                    self.stepping = False
            return step
        if phase not in ("static.run", "static.commit"):
            return fn

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.stepping:
                    self.spent += time.perf_counter() - t0
        return timed


def host_us_per_step(gamma: int, batch: int, requests: int = 256, new_tokens: int = 64, repeats: int = 3,
                     model: str = "glm5-tiny") -> float:
    rt = load_runtime(ModelSpec(model, "cpu", "fp32", random_weights=True), progress=False)
    pools = rt.make_pools(200, batch + 1)
    forwards = Forwards()
    with observing(forwards):
        engine = make_engine(rt, pools, EngineConfig(gamma=gamma, max_seq_len=256, eos_ids=(), graphs="static"))
        rnd = random.Random(0)
        reqs = [Request([rnd.randrange(rt.cfg.vocab_size) for _ in range(rnd.randrange(20, 60))], new_tokens, i)
                for i in range(requests)]
        try:
            engine.generate(reqs, batch_size=batch)  # warm-up: builds the static forwards
            best = None
            for _ in range(repeats):
                forwards.spent, forwards.steps, decode0 = 0.0, 0, engine.wall_decode_s
                engine.generate(reqs, batch_size=batch)
                host = (engine.wall_decode_s - decode0 - forwards.spent) / forwards.steps
                best = host if best is None else min(best, host)
            return best * 1e6
        finally:
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
