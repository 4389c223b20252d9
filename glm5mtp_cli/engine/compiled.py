"""Compiled static forwards (`--compile`): each fixed-shape forward of the engine (graphs.py) through
torch.compile, once per engine, before it is captured.

- off: the forwards as written (what runs without --compile);
- kernels: inductor compiles each forward; the hand-written kernels (kernels/*) are custom ops in
  it (kernels/_triton.py), called as they are while inductor fuses the glue around them;
- torch: the same with the models' pure-PyTorch code in place of every kernel (kernel path
  "torch"), compiled whole.

`--compile-mode`: inductor's default, or max-autotune-no-cudagraphs (it benchmarks GEMM and
fusion choices while compiling). Inductor's own CUDA graphs stay off in both: the engine captures
each compiled forward in its own graph, as it captures the uncompiled ones.

Every forward has fixed shapes (dynamic=False) and compiles as one graph (fullgraph=True: a graph
break is an error, never a forward split into pieces). Dynamo keeps its compiled code per code
object and refuses more than `recompile_limit` (8) entries for one, an error under fullgraph (a
silent fallback to eager without it); graphs.py's forwards share a few lambdas' code objects over
every bucket and gamma, so each compiled forward gets a copy of its code object of its own: one
cache entry each, whatever the number of buckets and gammas.

On the CPU the kernels' branch is the models' PyTorch code (kernel path "cuda" takes it only for
CUDA tensors), so kernels and torch compile the same forwards there.
"""

from __future__ import annotations

import types

import torch


# the kernel path (kernels/_triton.py) a compiled forward runs; kernels: the one set outside (default "cuda")
PATH_OF = {"torch": "torch"}


def default_compile(cfg) -> str:
    """The --compile a model runs without the flag: its family's `compile_default` (models/*/family.py)."""
    from glm5mtp_cli.models import family_of

    return getattr(family_of(cfg), "compile_default", "off")


def own_code(fn):
    """`fn` with a copy of its code object (module docstring: one dynamo cache entry per forward)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_forward(fn, mode: str = "default"):
    """fn compiled by inductor: fixed shapes, one graph, no inductor CUDA graphs (module docstring)."""
    return torch.compile(own_code(fn), fullgraph=True, dynamic=False,
                         mode=None if mode == "default" else mode)
