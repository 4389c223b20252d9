"""Optional Triton import and the launch plumbing shared by every kernel module.

Importing this module never fails: without Triton, ``HAVE_TRITON`` is False, ``tl`` is a stub
whose ``constexpr`` only lets the kernel signatures be defined, and every dispatcher falls back
to its PyTorch reference.

Kernels are decorated with :data:`jit` (``triton.jit``, or a no-op without Triton). Note that
``triton.jit`` picks compiler or interpreter when it decorates, and Triton's own standard library
(``tl.sum``, ``tl.max``...) is decorated when ``triton`` is imported: ``TRITON_INTERPRET=1`` must
be in the environment before the first ``import triton`` of the process. Tests therefore run the
interpreter in a fresh subprocess.

Which code runs where a model has a hand-written kernel is one switch, :data:`PATH` (set with
:func:`kernel_path` around a forward; the engine's compiled forwards do, engine/compiled.py):

- ``"cuda"`` (the default): the kernels' branch for CUDA tensors, the models' own PyTorch code on the CPU;
- ``"torch"``: never the kernels: the models' own PyTorch code, and every dispatcher its reference;
- ``"all"``: the kernels' branch for CPU tensors too, where each dispatcher runs its reference (the
  tests compile this branch, custom ops included, on the CPU).

Inside ``torch.compile`` a dispatcher calls its kernel as a custom op (``torch.ops.glm5mtp.*``,
registered beside each kernel): inductor cannot trace into a Triton launch wrapper (its shape
checks, allocation, host-side grid), and its own analysis of user-defined Triton kernels failed on
the paged-MLA kernel, so each op is opaque to it and inductor fuses the glue around the calls.
Outside a compiled forward the dispatchers call the kernels directly, as before (no dispatcher
hop, no extra copy).

Outputs are allocated with :func:`alloc`; with ``POISON_OUTPUTS`` set (tests and the benchmark
set it), they start filled with NaN so that an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import torch

try:  # pragma: no cover - which branch runs depends on the machine
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = SimpleNamespace(constexpr=object)  # only so that `X: tl.constexpr` annotations evaluate
    HAVE_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels would run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


PATHS = ("cuda", "torch", "all")
PATH = "cuda"


@contextlib.contextmanager
def kernel_path(path: str):
    """Run the enclosed forwards with PATH = `path` (module docstring)."""
    global PATH
    if path not in PATHS:
        raise ValueError(f"kernel path must be one of {', '.join(PATHS)}, got {path!r}")
    before, PATH = PATH, path
    try:
        yield
    finally:
        PATH = before


def use_kernels(x: torch.Tensor) -> bool:
    """Whether a model takes its hand-written-kernel branch for activations `x` (PATH)."""
    return x.is_cuda if PATH == "cuda" else PATH == "all"


def as_op() -> bool:
    """True while torch.compile traces a dispatcher that should appear as its custom op (every
    PATH but "torch", whose compiled forwards trace the references)."""
    return torch.compiler.is_compiling() and PATH != "torch"


def use_triton(*tensors: torch.Tensor, force: bool = False) -> bool:
    """Pick the Triton path: all tensors on CUDA (and Triton importable, PATH not "torch"), or
    `force` in the interpreter.

    Raises:
        RuntimeError: `force` was asked for but Triton cannot run these tensors.
    """
    if PATH == "torch" and not force:
        return False
    if HAVE_TRITON and all(t.is_cuda for t in tensors):
        return True
    if force:
        if HAVE_TRITON and interpreting() and not any(t.is_cuda for t in tensors):
            return True
        raise RuntimeError("force_triton needs Triton and either CUDA tensors or TRITON_INTERPRET=1")
    return False


def tracks_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd tracks any of these (training): kernels without a backward leave such
    calls to their references, which have one."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _no_jit(fn):
    return fn


jit = triton.jit if HAVE_TRITON else _no_jit

POISON_OUTPUTS = os.environ.get("KERNELS_POISON_OUTPUTS") == "1"


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Uninitialised output tensor; NaN-filled when ``POISON_OUTPUTS`` is set (floating dtypes)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS and dtype.is_floating_point:
        out.fill_(float("nan"))
    return out


def next_pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (16 is the smallest `tl.dot` side)."""
    p = minimum
    while p < n:
        p *= 2
    return p
