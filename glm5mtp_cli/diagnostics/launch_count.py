"""The kernels each phase of a speculative step launches, counted on the CPU: what a CUDA-graph
replay of that phase pays for, a few microseconds apiece, without a GPU (kernel_count.py measures
the target's forwards on one).

    python -m glm5mtp_cli.diagnostics.launch_count [MODEL] [--gamma G] [--ops]

A short greedy generate runs in static mode (the functions the CUDA graphs capture) on the
kernels' branch (kernels/_triton.PATH "all"). Each call of a kernels/ dispatcher counts as one
launch, as its Triton kernel would on the GPU; every other aten op counts as one, except views and
allocations, which launch nothing. An estimate, close but not exact: some aten ops launch two
kernels on a GPU (topk), and copies of host values into static buffers are counted where the
engine makes them. Prints each phase's launches at its last call (--ops: by op).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import pkgutil
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from glm5mtp_cli.engine.config import DEFAULT_MODEL, EngineConfig, ModelSpec
from glm5mtp_cli.engine.hooks import observing
from glm5mtp_cli.errors import UserError
from kernels._triton import kernel_path

# aten ops that only view or allocate: no kernel
NO_LAUNCH = {"view", "_unsafe_view", "t", "slice", "select", "expand", "unsqueeze", "squeeze", "as_strided",
             "permute", "transpose", "detach", "alias", "empty", "empty_strided", "split", "split_with_sizes",
             "unbind", "narrow", "lift_fresh", "_reshape_alias", "diagonal", "unflatten", "reshape"}
# the step's phases counted (engine/hooks.py), by the name printed
PHASES = {"runner.fused_chain": "draft chain", "runner.fused_chain_ahead": "draft chain ahead",
          "runner.catchup": "draft catch-up", "runner.chain_step": "draft chain step", "verify_ids": "verify ids",
          "runner.verify": "verify", "accept": "accept", "static.commit": "commit"}


class Launches(TorchDispatchMode):
    """Counts launches while `on`: aten ops outside a dispatcher, and each dispatcher call once."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.inside = 0  # dispatcher depth: its reference's ops are its one launch
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.on and not self.inside and name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def dispatcher(self, name: str, fn):
        def counted(*args, **kwargs):
            if self.on and not self.inside:
                self.ops["kernels." + name] += 1
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1
        counted.__wrapped__ = fn
        return counted


def _dispatchers() -> dict[int, str]:
    """id -> name of each kernels/ dispatcher: a public function with a `_ref` twin."""
    out = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name.startswith(("bench", "sweep", "_")):
            continue
        mod = importlib.import_module("kernels." + info.name)
        for name, fn in vars(mod).items():
            if callable(fn) and not name.endswith("_ref") and callable(vars(mod).get(name + "_ref")):
                out[id(fn)] = name
    return out


def _patch(owner, name: str, value, saved: list) -> None:
    saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def count_launches(model: str = DEFAULT_MODEL, gamma: int = 3, new_tokens: int = 24) -> dict[str, collections.Counter]:
    """Each phase's launches (by op) at its last call in a greedy static-mode generate of
    `new_tokens` tokens after a 64-token prompt, on the CPU."""
    from glm5mtp_cli.engine.runtime import load_runtime, make_engine
    from glm5mtp_cli.engine.sequence import Request

    rt = load_runtime(ModelSpec(model, "cpu", "fp32"), progress=False)
    mode, saved, last = Launches(), [], {}
    dispatchers = _dispatchers()
    try:
        for modname, mod in list(sys.modules.items()):  # each dispatcher where the models import it
            if mod is not None and modname.startswith(("glm5mtp_cli", "kernels")):
                for name, fn in list(vars(mod).items()):
                    if callable(fn) and id(fn) in dispatchers:
                        _patch(mod, name, mode.dispatcher(dispatchers[id(fn)], fn), saved)
        with observing(Counted(mode, last)):
            engine = make_engine(rt, rt.make_pools(512, 2), EngineConfig(gamma=gamma, max_seq_len=512, graphs="static"))
            with mode:
                engine.generate([Request(list(range(5, 69)), new_tokens, 0)], batch_size=1)
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
    return last


class Counted:
    """An observer (engine/hooks.py) counting each of PHASES' launches at its last call."""

    def __init__(self, mode: Launches, last: dict):
        self.mode, self.last = mode, last

    def wrap(self, obj, phase: str, fn):
        if phase not in PHASES:
            return fn
        mode, last, name = self.mode, self.last, PHASES[phase]

        def run(*args, **kwargs):
            if mode.on:  # inside another phase: counted there
                return fn(*args, **kwargs)
            mode.on, mode.ops = True, collections.Counter()
            try:
                with kernel_path("all"):
                    return fn(*args, **kwargs)
            finally:
                mode.on = False
                last[name] = mode.ops
        return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--ops", action="store_true", help="each phase's launches by op")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        phases = count_launches(args.model, args.gamma)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for phase, ops in phases.items():
        print(f"{phase:18s} {sum(ops.values()):5d}")
        if args.ops:
            print("    " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
