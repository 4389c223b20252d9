"""SwiGLU's activation: silu(gate) * up, with GLM-5-Next's clamps (gate from above at `limit`, up to
[-limit, limit]), in one launch where PyTorch takes four (two without a limit). In a nano model's
graph replay every launch costs a few microseconds whatever its size, and the shared expert and
each dense MLP run one per forward.

Semantics (the models' own, models/glm5/layers.swiglu): the clamps, then silu rounded to the input
dtype, then the product rounded to it, as PyTorch computes each op in fp32 and rounds its result.
gate and up may be column slices of one joined gate-up projection (strided rows); the output is
contiguous.
"""

import torch

from ._triton import alloc, as_op, jit, tl, use_triton


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """PyTorch reference: gate, up [..., I] -> [..., I] in their dtype."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


@jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, limit,
                   HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:  # clamped in the dtype, as the reference's clamp returns it (a limit rounds as it would)
        g = tl.minimum(g, limit).to(out_ptr.dtype.element_ty).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(out_ptr.dtype.element_ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Triton version of :func:`swiglu_ref`; one program per row and 1024 columns."""
    n = gate.shape[-1]
    assert up.shape == gate.shape and up.dtype == gate.dtype, "gate and up must match"
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    assert g2.stride(-1) == 1 and u2.stride(-1) == 1, "gate and up need a unit stride in their last dimension"
    out = alloc(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, max(16, 1 << (n - 1).bit_length()))
    if g2.shape[0] and n:
        _swiglu_kernel[(g2.shape[0], -(-n // block))](g2, u2, out, n, g2.stride(0), u2.stride(0),
                                                       0.0 if limit is None else float(limit),
                                                       HAS_LIMIT=limit is not None, BLOCK=block,
                                                       num_warps=max(1, min(4, block // 256)))
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, force_triton: bool = False):
    """silu(gate) * up with the optional clamps (module docstring); the Triton kernel for CUDA
    tensors (or `force_triton` in the interpreter), else the reference."""
    if as_op():
        return swiglu_op(gate, up, limit)
    if use_triton(gate, up, force=force_triton):
        return swiglu_triton(gate, up, limit)
    return swiglu_ref(gate, up, limit)


# As a custom op for compiled forwards (_triton's docstring).
@torch.library.custom_op("glm5mtp::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if use_triton(gate, up):
        return swiglu_triton(gate, up, limit)
    return swiglu_ref(gate, up, limit).contiguous()


@swiglu_op.register_fake
def _(gate, up, limit):
    return gate.new_empty(gate.shape)
