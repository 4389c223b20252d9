"""Optional Triton import and the launch plumbing shared by every kernel module.

Importing this module never fails: without Triton, ``HAVE_TRITON`` is False, ``tl`` is a stub
whose ``constexpr`` only lets the kernel signatures be defined, and every dispatcher falls back
to its PyTorch reference.

Kernels are decorated with :data:`jit` (``triton.jit``, or a no-op without Triton). Note that
``triton.jit`` picks compiler or interpreter when it decorates, and Triton's own standard library
(``tl.sum``, ``tl.max``...) is decorated when ``triton`` is imported: ``TRITON_INTERPRET=1`` must
be in the environment before the first ``import triton`` of the process. Tests therefore run the
interpreter in a fresh subprocess.

Outputs are allocated with :func:`alloc`; with ``POISON_OUTPUTS`` set (tests and the benchmark
set it), they start filled with NaN so that an element a kernel forgets to write shows up.
"""

from __future__ import annotations

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


def use_triton(*tensors: torch.Tensor, force: bool = False) -> bool:
    """Pick the Triton path: all tensors on CUDA (and Triton importable), or `force` in the interpreter.

    Raises:
        RuntimeError: `force` was asked for but Triton cannot run these tensors.
    """
    if HAVE_TRITON and all(t.is_cuda for t in tensors):
        return True
    if force:
        if HAVE_TRITON and interpreting() and not any(t.is_cuda for t in tensors):
            return True
        raise RuntimeError("force_triton needs Triton and either CUDA tensors or TRITON_INTERPRET=1")
    return False


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
