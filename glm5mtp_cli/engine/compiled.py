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
    from glm5mtp_cli.core.families import family_of

    return getattr(family_of(cfg), "compile_default", "off")


def own_code(fn):
    """`fn` with a copy of its code object (module docstring: one dynamo cache entry per forward)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def lower_kernels_as_fallbacks() -> None:
    """Register every glm5mtp custom op registered so far with inductor as a fallback (a call of the
    op as it is), with the layout constraint inductor would give it itself.

    Left to inductor, an op gets its fallback at its first use in a graph, and torch 2.11 first
    formats an INFO message printing its inputs' whole IR, logged or not (pytorch#185937, fixed in
    later releases). Through GLM-5-Next's chains of mHC and KDA ops that took 60 s of the first
    forward's 68 s compile on an H100."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op_name = name.partition("::")
        if namespace != "glm5mtp":
            continue
        op = getattr(torch.ops.glm5mtp, op_name).default
        if op not in lowerings:
            make_fallback(op, layout_constraint=tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True)))


def compile_forward(fn, mode: str = "default"):
    """fn compiled by inductor: fixed shapes, one graph, no inductor CUDA graphs (module docstring)."""
    lower_kernels_as_fallbacks()
    return torch.compile(own_code(fn), fullgraph=True, dynamic=False,
                         mode=None if mode == "default" else mode)
