"""Where a run's steps and admissions spend their time, around any `glm5mtp` command (on the GPU
the run uses: host_time.py measures the step loop on this CPU instead):

    python3 -m glm5mtp_cli.diagnostics.step_phases [--kernels N] bench --model M --device cuda ...

Each phase of SpecEngine.step is timed on the host without adding a sync, so a phase shows what the
host spends launching and bookkeeping, and the verdict's read (`read`), the step's one host read,
holds the wait for the device too. Each admission's target and drafter prefills are timed with a
sync after each (an admission syncs at both ends anyway; a step's catch-up prefill is not timed
apart: it stays in its phase, unsynced). Warm-up runs are counted with the timed
ones. Prints one JSON line per (slots, gamma) to stderr: microseconds a step for each phase, and
each prefill's seconds and calls in all. `--kernels N`: the command runs under torch.profiler, and
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

from glm5mtp_cli.engine import grammar, speculate
from glm5mtp_cli.engine.accept import Verdict
from glm5mtp_cli.engine.graphs import ForwardRunner

STEP_PHASES = ("_schedule", "_catch_up_backlog", "draft", "_verify_ids", "_accept", "_commit_device", "_draft_ahead",
               "_commit", "_finish", "_masks", "_judge")
RUNNER_PHASES = ("step", "verify", "commit", "mask")
GRAMMAR_PHASES = ((grammar.StepMasks, "read_drafts"), (grammar.StepMasks, "verify"), (grammar.SeqGrammar, "commit"))
PREFILLS = ("prefill_targets", "prefill_drafters")


class Phases:
    """Seconds per phase and steps, per (slots, gamma) of the step that ran them."""

    def __init__(self) -> None:
        self.seconds: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.steps: collections.Counter = collections.Counter()
        self.calls: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.key = None
        self.admitting = False  # inside an admission: its prefills are timed (not a catch-up's)

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

    def timed_prefill(self, fn, name: str, sync):
        """An admission's prefill, synced after; a step's catch-up (same function) left untimed."""
        timed = self.timed(fn, name, sync)
        return lambda *args, **kwargs: (timed if self.admitting else fn)(*args, **kwargs)

    def admission(self, fn):
        def run(*args, **kwargs):
            self.admitting = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.admitting = False
        return run

    def rows(self) -> list[dict]:
        out = []
        for key, secs in self.seconds.items():
            steps = self.steps[key] or 1
            row = {"slots": key[0], "gamma": key[1], "steps": self.steps[key]}
            row.update({f"{n}_us": round(s / steps * 1e6, 1) for n, s in secs.items() if n not in PREFILLS})
            for n in PREFILLS:
                if n in secs:
                    row[f"{n}_s"], row[f"{n}_calls"] = round(secs[n], 4), self.calls[key][n]
            out.append(row)
        return out


def install(phases: Phases, device_sync) -> list[tuple[object, str, object]]:
    """Wrap the engine's phases; -> what to restore."""
    saved = []

    def patch(owner, name, wrapped):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrapped)

    step = phases.timed(speculate.SpecEngine.step, "step")

    def keyed_step(engine, run):
        phases.key = (len(run.slots), engine.gamma)
        phases.steps[phases.key] += 1
        return step(engine, run)

    patch(speculate.SpecEngine, "step", keyed_step)
    for name in STEP_PHASES:
        patch(speculate.SpecEngine, name, phases.timed(getattr(speculate.SpecEngine, name), name))
    for name in RUNNER_PHASES:
        patch(ForwardRunner, name, phases.timed(getattr(ForwardRunner, name), f"runner.{name}"))
    for owner, name in GRAMMAR_PHASES:  # a constrained step's host work (_finish holds the commit, _judge)
        patch(owner, name, phases.timed(getattr(owner, name), f"{owner.__name__}.{name}"))
    patch(Verdict, "read", phases.timed(Verdict.read, "read"))
    patch(speculate.SpecEngine, "_admit_into", phases.admission(speculate.SpecEngine._admit_into))
    for name in PREFILLS:
        patch(speculate, name, phases.timed_prefill(getattr(speculate, name), name, device_sync))
    return saved


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
    phases = Phases()
    saved = install(phases, torch.cuda.synchronize if torch.cuda.is_available() else lambda: None)
    try:
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                code = cli_main(args.command)
            print(kernel_table(prof, args.kernels), file=sys.stderr)
        else:
            code = cli_main(args.command)
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
    for row in phases.rows():
        print(json.dumps(row), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
