"""Per-step wall times of one request (batch 1), one engine per --compile mode in turns, the second
of two generate calls on each engine: the median and first steps, and per phase (verify, accept,
the fixed-size state's commit, finish) the seconds with the device synchronized around it (so the
phases cost a little more than in a plain run). One JSON line per engine.

    python3 tests/step_walls.py MODEL GAMMA off,kernels,off,kernels NEW_TOKENS
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from glm5mtp_cli.engine.config import EngineConfig, ModelSpec
from glm5mtp_cli.engine.hooks import observing
from glm5mtp_cli.engine.runtime import load_runtime, make_engine
from glm5mtp_cli.engine.sequence import Request


class Synced:
    """An observer (engine/hooks.py): the step's wall times, and each of `phases` synchronized around."""

    NAMES = {"runner.verify": "verify", "accept": "accept", "static.commit": "commit", "finish": "finish"}

    def __init__(self, sync):
        self.sync, self.walls, self.phases = sync, [], dict.fromkeys(self.NAMES.values(), 0.0)

    def wrap(self, obj, phase: str, fn):
        if phase == "step":
            def walled(run):
                t0 = time.perf_counter()
                fn(run)
                self.walls.append(time.perf_counter() - t0)
            return walled
        if phase not in self.NAMES:
            return fn

        def run(*args):
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args)
            self.sync()
            self.phases[self.NAMES[phase]] += time.perf_counter() - t0
            return out
        return run


def measure(rt, gamma: int, compile: str, new_tokens: int, sync) -> dict:
    synced = Synced(sync)
    with observing(synced):
        engine = make_engine(rt, rt.make_pools(256, 2), EngineConfig(gamma=gamma, max_seq_len=256, eos_ids=(),
                                                                     compile=compile))
        try:
            for _ in range(2):  # the second call: the engine's graphs built and warm
                synced.walls.clear()
                synced.phases.update(dict.fromkeys(synced.phases, 0.0))
                engine.generate([Request(list(range(5, 40)), new_tokens, 0)], batch_size=1)
        finally:
            engine.close()
    walls = synced.walls
    return {"compile": compile, "median_ms": statistics.median(walls) * 1e3, "first5_ms": [w * 1e3 for w in walls[:5]],
            "max_ms": max(walls) * 1e3, "sum_s": sum(walls), "steps": len(walls), "phases_s": synced.phases,
            "compile_s": engine.runner.compile_s}


def main() -> None:
    model, gamma, modes, new_tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rt = load_runtime(ModelSpec(model, "cuda" if cuda else "cpu", "bf16" if cuda else "fp32"), progress=False)
    for compile in modes:
        print(json.dumps(measure(rt, gamma, compile, new_tokens, sync)), flush=True)


if __name__ == "__main__":
    main()
