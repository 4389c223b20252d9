"""Interleaved rotary embedding (GLM-5's `rope_interleave`).

The input pairs are (x0, x1), (x2, x3), ...; pair i at position t turns by the angle whose cosine
and sine are ``cos[t, i]`` and ``sin[t, i]``. The output is laid out de-interleaved:
``[x_even*cos - x_odd*sin, x_odd*cos + x_even*sin]`` (first half the rotated evens, second half
the rotated odds), which is what Hugging Face's interleaved path produces. Math in fp32, one
rounding to ``x.dtype`` at the end.
"""

import torch

from ._triton import alloc, as_op, jit, next_pow2, tl, triton, use_triton


def rope_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: x [T, H, D] or [T, D]; cos, sin [T, D/2]. Returns x's shape and dtype."""
    xf = x.float()
    c, s = cos.float(), sin.float()
    if x.dim() == 3:
        c, s = c[:, None, :], s[:, None, :]
    xe, xo = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([xe * c - xo * s, xo * c + xe * s], dim=-1).to(x.dtype)


@jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, HALF, stride_xt, stride_xh, stride_ct,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < HALF
    mask = (heads[:, None] < H) & dmask[None, :]
    c = tl.load(cos_ptr + t * stride_ct + offs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_ct + offs, mask=dmask, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh + 2 * offs[None, :]
    xe = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (t * H + heads[:, None].to(tl.int64)) * (2 * HALF) + offs[None, :]
    tl.store(dst, (xe * c - xo * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (xo * c + xe * s).to(out_ptr.dtype.element_ty), mask=mask)


def rope_interleaved_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`rope_interleaved_ref`; grid (T, head blocks).

    `x` may be a strided view (say the rope slice of q) with a unit last stride; the output is
    contiguous.
    """
    assert x.dim() in (2, 3), "x must be [T, D] or [T, H, D]"
    t, d = x.shape[0], x.shape[-1]
    assert d % 2 == 0, "rotary width must be even"
    half = d // 2
    assert cos.shape == (t, half) and sin.shape == (t, half), "cos/sin must be [T, D/2]"
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1, "cos and sin need the same unit-stride layout"
    assert x.stride(-1) == 1, "x needs a unit stride in its last dimension"
    h = x.shape[1] if x.dim() == 3 else 1
    stride_xh = x.stride(1) if x.dim() == 3 else 0
    out = alloc(x.shape, dtype=x.dtype, device=x.device)
    if t and h:
        block_h = min(16, next_pow2(h, 1))
        _rope_kernel[(t, triton.cdiv(h, block_h))](x, cos, sin, out, h, half, x.stride(0), stride_xh, cos.stride(0),
                                            BLOCK_H=block_h, BLOCK_D=next_pow2(half, 1), num_warps=4)
    return out


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, force_triton: bool = False) -> torch.Tensor:
    """Apply interleaved rotary embedding, de-interleaving the output (see the module docstring).

    Args:
        x: [T, H, D] or [T, D].
        cos, sin: [T, D/2] for the positions of the T rows.
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        Tensor of x's shape and dtype.
    """
    if as_op():
        return rope_interleaved_op(x, cos, sin)
    if use_triton(x, cos, sin, force=force_triton):
        return rope_interleaved_triton(x, cos, sin)
    return rope_interleaved_ref(x, cos, sin)


@torch.library.custom_op("glm5mtp::rope_interleaved", mutates_args=())
def rope_interleaved_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The dispatcher as a custom op for compiled forwards (kernels/_triton.py's docstring)."""
    if use_triton(x, cos, sin):
        return rope_interleaved_triton(x, cos, sin)
    return rope_interleaved_ref(x, cos, sin)


@rope_interleaved_op.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
