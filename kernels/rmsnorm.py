"""RMSNorm, optionally fused with the residual add that precedes it; and KDA's gated per-head RMSNorm
(`gated_rmsnorm`, one launch for what PyTorch does in twelve).

Semantics (Hugging Face's): ``y = (xf * rsqrt(mean(xf^2) + eps)).to(x.dtype) * weight`` with
``xf = x.float()``; the cast back to the input dtype comes BEFORE the weight product, and the
output dtype is ``torch.promote_types(x.dtype, weight.dtype)``. With ``residual`` the input is
``h = x + residual`` (added, then rounded, in ``x.dtype``) and the result is ``(y, h)``.
"""

import torch

from ._triton import alloc, as_op, jit, next_pow2, tl, tracks_grad, use_triton


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """PyTorch reference. Returns y, or (y, x + residual) when `residual` is given."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return y if residual is None else (y, h)


@jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, N, stride_x, stride_r, eps,
                    HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)  # rounded like torch's add in x.dtype
        tl.store(h_ptr + row * N + offs, h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Triton version of :func:`rmsnorm_ref` (same arguments and results); one program per row.

    `x` and `residual` may be strided views (say the latent slice of a fused projection) as long
    as they flatten to rows with a unit last stride; the outputs are contiguous.
    """
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous(), f"weight {tuple(weight.shape)} vs width {n}"
    x2 = x.reshape(-1, n)  # a view when the leading dims flatten, else a copy
    assert x2.stride(-1) == 1, "x needs a unit stride in its last dimension"
    r2 = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        r2 = residual.reshape(-1, n)
        assert r2.stride(-1) == 1, "residual needs a unit stride in its last dimension"
    rows = x2.shape[0]
    y = alloc(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    h = alloc(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if rows:
        block = next_pow2(n)
        _rmsnorm_kernel[(rows,)](x2, r2 if r2 is not None else x2, weight, y,
                          h if h is not None else y, n, x2.stride(0),
                          r2.stride(0) if r2 is not None else 0, eps,
                          HAS_RES=residual is not None, BLOCK_N=block,
                          num_warps=min(16, max(1, block // 512)))
    return y if residual is None else (y, h)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            force_triton: bool = False):
    """RMSNorm over the last dimension (fused with a residual add when `residual` is given).

    Args:
        x: [..., N] activations.
        weight: [N] scale.
        eps: added to the mean square.
        residual: optional [..., N] tensor added to `x` first.
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        y, or (y, x + residual).
    """
    if residual is None and as_op():
        return rmsnorm_op(x, weight, eps)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if use_triton(*tensors, force=force_triton):
        return rmsnorm_triton(x, weight, eps, residual)
    return rmsnorm_ref(x, weight, eps, residual)


# The models' form (no residual) as a custom op for compiled forwards (_triton's docstring).
@torch.library.custom_op("glm5mtp::rmsnorm", mutates_args=())
def rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x, weight):
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps).contiguous()  # the kernel's layout, whatever x's strides


@rmsnorm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


# ---- the MTP layer's input: two norms side by side ---------------------------------------------------

def rmsnorm_pair_ref(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., 2 N]: rmsnorm_ref(a, wa) beside rmsnorm_ref(b, wb) (a, b [..., N] of one dtype): the MTP
    layer's [enorm(embedding) ; hnorm(hidden)] before eh_proj."""
    return torch.cat([rmsnorm_ref(a, wa, eps), rmsnorm_ref(b, wb, eps)], dim=-1)


@jit
def _rmsnorm_pair_kernel(a_ptr, b_ptr, wa_ptr, wb_ptr, y_ptr, N, stride_a, stride_b, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    for half in tl.static_range(2):
        if half == 0:
            x = tl.load(a_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(wa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(b_ptr + row * stride_b + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(wb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        normed = (x * rstd).to(a_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * 2 * N + half * N + offs, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm_pair_triton(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of :func:`rmsnorm_pair_ref`; one program per row writes both halves."""
    n = a.shape[-1]
    assert b.shape == a.shape and b.dtype == a.dtype, "a and b must match"
    assert wa.shape == wb.shape == (n,) and wa.dtype == wb.dtype and wa.is_contiguous() and wb.is_contiguous()
    a2, b2 = a.reshape(-1, n), b.reshape(-1, n)
    assert a2.stride(-1) == 1 and b2.stride(-1) == 1, "a and b need a unit stride in their last dimension"
    y = alloc((*a.shape[:-1], 2 * n), dtype=torch.promote_types(a.dtype, wa.dtype), device=a.device)
    if a2.shape[0]:
        block = next_pow2(n)
        _rmsnorm_pair_kernel[(a2.shape[0],)](a2, b2, wa, wb, y, n, a2.stride(0), b2.stride(0), eps, BLOCK_N=block,
                                             num_warps=min(16, max(1, block // 512)))
    return y


def rmsnorm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float,
                 force_triton: bool = False) -> torch.Tensor:
    """rmsnorm_pair_ref's result: the Triton kernel for CUDA tensors (or `force_triton` in the
    interpreter), else the reference. Compiled forwards trace the reference: inductor fuses it."""
    if not torch.compiler.is_compiling() and use_triton(a, wa, b, wb, force=force_triton):
        return rmsnorm_pair_triton(a, wa, b, wb, eps)
    return rmsnorm_pair_ref(a, wa, b, wb, eps)


# ---- KDA's output gate -----------------------------------------------------------------------------

def gated_rmsnorm_ref(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                      dtype: torch.dtype) -> torch.Tensor:
    """GLM-5-Next's KDA output (models/glm5_next/kda.py): o [..., H, d] rounded to `dtype`, each head
    RMS-normalised in fp32 with its weight [d] (weight included before the cast), times
    sigmoid(gate) (gate [..., H * d]); [..., H * d] in `dtype`."""
    of = o.to(dtype).float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    of = of * torch.sigmoid(gate.float().reshape(of.shape))
    return of.to(dtype).reshape(*o.shape[:-2], -1)


@jit
def _gated_rmsnorm_kernel(o_ptr, g_ptr, w_ptr, out_ptr, D, g_row, H, eps, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # row * H + head
    d = tl.arange(0, BLOCK_D)
    m = d < D
    dt = out_ptr.dtype.element_ty
    x = tl.load(o_ptr + i * D + d, mask=m, other=0.0).to(dt).to(tl.float32)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)) * tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + (i // H) * g_row + (i % H) * D + d, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i * D + d, (x * tl.sigmoid(g)).to(dt), mask=m)


def gated_rmsnorm_triton(o, gate, weight, eps: float, dtype: torch.dtype):
    h, d = o.shape[-2:]
    o2 = o.contiguous()
    g2 = gate.reshape(-1, h * d)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    out = alloc((*o.shape[:-2], h * d), dtype, o.device)
    n = o2.numel() // d
    if n:
        _gated_rmsnorm_kernel[(n,)](o2, g2, weight.contiguous(), out, d, g2.stride(0), h, eps, BLOCK_D=next_pow2(d))
    return out


def gated_rmsnorm(o, gate, weight, eps: float, dtype: torch.dtype, force_triton: bool = False):
    """gated_rmsnorm_ref's result; the Triton kernel for CUDA tensors (or `force_triton` in the interpreter)."""
    if as_op() and not tracks_grad(o, gate, weight):
        return gated_rmsnorm_op(o, gate, weight, eps, dtype)
    if use_triton(o, gate, weight, force=force_triton) and not tracks_grad(o, gate, weight):
        return gated_rmsnorm_triton(o, gate, weight, eps, dtype)
    return gated_rmsnorm_ref(o, gate, weight, eps, dtype)


@torch.library.custom_op("glm5mtp::gated_rmsnorm", mutates_args=())
def gated_rmsnorm_op(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                     dtype: torch.dtype) -> torch.Tensor:
    if use_triton(o, gate, weight):
        return gated_rmsnorm_triton(o, gate, weight, eps, dtype)
    return gated_rmsnorm_ref(o, gate, weight, eps, dtype).contiguous()


@gated_rmsnorm_op.register_fake
def _(o, gate, weight, eps, dtype):
    return o.new_empty((*o.shape[:-2], o.shape[-2] * o.shape[-1]), dtype=dtype)
