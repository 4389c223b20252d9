"""Where a run's steps and admissions spend their time, around any `glm5mtp` command (on the GPU
the run uses: host_time.py measures the step loop on this CPU instead):

    python3 -m glm5mtp_cli.diagnostics.step_phases [--kernels N] bench --model M --device cuda ...

Each phase the engine's objects declare (engine/hooks.py: the step's, the runner's, the grammar's, the
static forwards') is timed on the host without adding a sync, so a phase shows what the host spends
launching and bookkeeping, and the verdict's read (`read`), the step's one host read, holds the wait
for the device too; phases nest (the runner's inside the step's). Each admission is timed with the
device caught up at its end (it syncs at both ends anyway). Warm-up runs are counted with the timed
ones. Prints one JSON line per (slots, gamma) to stderr: microseconds a step for each phase, and
the admissions' seconds and calls in all. `--kernels N`: the command runs under torch.profiler, and
the N kernels with the most device time follow as a table (their own times: the profiler's rows for
ops count their kernels again).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch

from glm5mtp_cli.engine.hooks import observing

PREFILLS = ("admit",)  # timed with the device caught up at both ends (the admission syncs anyway)


class Phases:
    """Seconds per phase and steps, per (slots, gamma) of the step that ran them: an observer of every
    phase the engine's objects declare (engine/hooks.py)."""

    def __init__(self, device_sync) -> None:
        self.seconds: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.steps: collections.Counter = collections.Counter()
        self.calls: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.key = None
        self.sync = device_sync

    def wrap(self, obj, phase: str, fn):
        timed = self.timed(fn, phase, self.sync if phase in PREFILLS else None)
        if phase != "step":
            return timed

        def keyed_step(run):
            self.key = (len(run.slots), obj.gamma)
            self.steps[self.key] += 1
            return timed(run)
        return keyed_step

    def timed(self, fn, name: str, sync=None):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                self.seconds[self.key][name] += time.perf_counter() - t0
                self.calls[self.key][name] += 1
        return run

    def rows(self) -> list[dict]:
        out = []
        for key, secs in self.seconds.items():
            if key is None:
                continue  # before the first step: an engine's first admission
            steps = self.steps[key] or 1
            row = {"slots": key[0], "gamma": key[1], "steps": self.steps[key]}
            row.update({f"{n}_us": round(s / steps * 1e6, 1) for n, s in secs.items() if n not in PREFILLS})
            for n in PREFILLS:
                if n in secs:
                    row[f"{n}_s"], row[f"{n}_calls"] = round(secs[n], 4), self.calls[key][n]
            out.append(row)
        return out


def kernel_table(prof, rows: int) -> str:
    """The kernels (device events) with the most device time."""
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    lines = [f"{'device ms':>10} {'calls':>7} {'us a call':>10}  kernel"]
    for e in kernels[:rows]:
        ms = e.self_device_time_total / 1e3
        lines.append(f"{ms:10.2f} {e.count:7d} {ms * 1e3 / max(e.count, 1):10.2f}  {e.key[:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=0, help="run under torch.profiler; print the N top kernels")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="a glm5mtp command line, e.g. bench --model M ...")
    args = ap.parse_args(argv)
    from glm5mtp_cli.cli import main as cli_main

    if args.kernels and not torch.cuda.is_available():
        print("step_phases --kernels needs a CUDA device", file=sys.stderr)
        return 2
    phases = Phases(torch.cuda.synchronize if torch.cuda.is_available() else lambda: None)
    with observing(phases):
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                code = cli_main(args.command)
            print(kernel_table(prof, args.kernels), file=sys.stderr)
        else:
            code = cli_main(args.command)
    for row in phases.rows():
        print(json.dumps(row), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
