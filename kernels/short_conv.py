"""KDA's short causal conv (models/glm5_next/kda.py): depthwise over the last K-1 rows and the new ones,
then SiLU, as one kernel.

PyTorch's form is seven launches per layer (the window joined to the rows, fp32 copies of both
operands, the unfolded product, its sum, the SiLU, the cast back); here one program per sequence and
block of channels writes the extended window (window | new rows, what the commit keeps its next
window from) and the conv's outputs, reading the rows in place (a strided slice of a joined
projection).
"""

import torch

from ._triton import alloc, as_op, jit, next_pow2, tl, tracks_grad, use_triton


def short_conv_ref(z: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z [..., T, C] (pre-conv rows), window [..., K-1, C] (the K-1 rows before z; zeros at a sequence's
    start), weight [C, K]. Returns (silu(conv) [..., T, C] in z's dtype, the extended window
    [..., K-1+T, C] in z's dtype); fp32 products and sum."""
    k = weight.shape[-1]
    full = torch.cat([window.to(z.dtype), z], dim=-2)
    cols = full.float().unfold(-2, k, 1)  # [..., T, C, K]: column j is row t+j of `full`
    out = torch.nn.functional.silu((cols * weight.float()).sum(-1))
    return out.to(z.dtype), full


@jit
def _short_conv_kernel(z_ptr, win_ptr, w_ptr, out_ptr, ext_ptr, T, C, z_seq, z_row, win_seq,
                       K: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    dt = ext_ptr.dtype.element_ty
    z = z_ptr + b * z_seq + c
    win = win_ptr + b * win_seq + c
    ext = ext_ptr + b * (K - 1 + T) * C + c
    for i in tl.static_range(K - 1):
        tl.store(ext + i * C, tl.load(win + i * C, mask=cm, other=0.0).to(dt), mask=cm)
    for t in range(T):
        tl.store(ext + (K - 1 + t) * C, tl.load(z + t * z_row, mask=cm, other=0.0), mask=cm)
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in tl.static_range(K):
            r = t + j  # row of window | z
            in_win = (tl.zeros((BLOCK_C,), dtype=tl.int32) + r) < K - 1
            old = tl.load(win + r * C, mask=cm & in_win, other=0.0).to(dt)
            new = tl.load(z + (r - (K - 1)) * z_row, mask=cm & ~in_win, other=0.0)
            x = tl.where(in_win, old, new).to(tl.float32)
            acc += x * tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)
        tl.store(out_ptr + (b * T + t) * C + c, (acc * tl.sigmoid(acc)).to(dt), mask=cm)


def short_conv_triton(z, window, weight):
    *lead, t, c = z.shape
    k = weight.shape[-1]
    z3 = z.reshape(-1, t, c)  # a view for the leading dims of a batched forward
    if z3.stride(-1) != 1:
        z3 = z3.contiguous()
    win = window.reshape(-1, k - 1, c).contiguous()
    nb = z3.shape[0]
    out = alloc((*lead, t, c), z.dtype, z.device)
    ext = alloc((*lead, k - 1 + t, c), z.dtype, z.device)
    if nb and c:
        block = min(next_pow2(c), 256)
        _short_conv_kernel[(nb, -(-c // block))](z3, win, weight.contiguous(), out, ext, t, c, z3.stride(0),
                                                z3.stride(1), win.stride(0), K=k, BLOCK_C=block)
    return out, ext


def short_conv(z, window, weight, force_triton: bool = False):
    """short_conv_ref's results; the Triton kernel for CUDA tensors (or `force_triton` in the interpreter)."""
    if as_op() and not tracks_grad(z, window, weight):
        return short_conv_op(z, window, weight)
    if use_triton(z, window, weight, force=force_triton) and not tracks_grad(z, window, weight):
        return short_conv_triton(z, window, weight)
    return short_conv_ref(z, window, weight)


# As a custom op for compiled forwards (_triton's docstring).
@torch.library.custom_op("glm5mtp::short_conv", mutates_args=())
def short_conv_op(z: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(z, window, weight):
        return short_conv_triton(z, window, weight)
    return tuple(t.contiguous() for t in short_conv_ref(z, window, weight))


@short_conv_op.register_fake
def _(z, window, weight):
    k = weight.shape[-1]
    return z.new_empty(z.shape), z.new_empty((*z.shape[:-2], k - 1 + z.shape[-2], z.shape[-1]))
