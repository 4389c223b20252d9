"""KDA's short causal conv (models/glm5_next/kda.py): depthwise over the last K-1 rows and the new ones,
then SiLU, as one kernel.

PyTorch's form is seven launches per layer (the window joined to the rows, fp32 copies of both
operands, the unfolded product, its sum, the SiLU, the cast back); here one program per sequence,
block of channels and block of rows writes the extended window (window | new rows, what the commit
keeps its next window from) and the conv's outputs, reading the rows in place (a strided slice of a
joined projection).
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
                       K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Sequence b's rows [tb BLOCK_T, (tb + 1) BLOCK_T) in one block of channels: their conv over
    window | z and their rows of the extended window (the first row block also copies the window).
    Rows are a tile, not a loop: when a program walked its sequence's rows one after another, the
    kernel averaged 29 us a call over glm5next-nano's batch-64 HumanEval run (H100 profile; decode
    calls, one row, among them), the prefill's hundreds of rows a sequence the cost."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tb = tl.program_id(2)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cm = c < C
    live = (t < T)[:, None] & cm[None, :]
    dt = ext_ptr.dtype.element_ty
    z = z_ptr + b * z_seq + c[None, :]
    win = win_ptr + b * win_seq + c[None, :]
    ext = ext_ptr + b * (K - 1 + T) * C + c[None, :]
    if tb == 0:
        for i in tl.static_range(K - 1):
            tl.store(ext + i * C, tl.load(win + i * C, mask=cm[None, :], other=0.0).to(dt), mask=cm[None, :])
    tl.store(ext + (K - 1 + t)[:, None] * C, tl.load(z + t[:, None] * z_row, mask=live, other=0.0), mask=live)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        r = (t + j)[:, None]  # row of window | z
        in_win = r < K - 1
        old = tl.load(win + r * C, mask=live & in_win, other=0.0).to(dt)
        new = tl.load(z + (r - (K - 1)) * z_row, mask=live & ~in_win, other=0.0)
        x = tl.where(in_win, old, new).to(tl.float32)
        acc += x * tl.load(w_ptr + c * K + j, mask=cm, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (b * T + t)[:, None] * C + c[None, :], (acc * tl.sigmoid(acc)).to(dt), mask=live)


ROWS = 16  # a program's rows: a decode's one, a verify's few, a prefill's in tiles of 16


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
        block, rows = min(next_pow2(c), 256), min(next_pow2(t, 1), ROWS)
        row_blocks = max(1, -(-t // rows))  # no rows: one block still copies the window
        _short_conv_kernel[(nb, -(-c // block), row_blocks)](z3, win, weight.contiguous(), out, ext, t, c,
                                                            z3.stride(0), z3.stride(1), win.stride(0), K=k,
                                                            BLOCK_T=rows, BLOCK_C=block)
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
