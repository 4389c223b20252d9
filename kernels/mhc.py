"""mHC, GLM-5-Next's hyper-connections (models/glm5_next/mhc.py), as three kernels per block site.

PyTorch spends ~140 launches on one site: the Sinkhorn normalisation alone is two reductions and two
divisions per iteration over a [T, n, n] tensor (20 iterations in GLM-5-Next), and at decode every
one of them is a launch on a few hundred bytes. Here:

- `hc_mix`: the mixing logits m [T, (2+n)n] -> pre [T, n], post [T, n], comb [T, n, n] (sigmoids,
  the row softmax and every Sinkhorn iteration in registers, one program per block of tokens);
- `hc_collapse`: the block input sum_i pre_i X_i (fp32 sum, cast to the stream dtype);
- `hc_expand`: the new streams X_k <- post_k y + sum_j comb[j, k] X_j, rounded where PyTorch's
  reference rounds (the product, the matmul, their sum, each once in the stream dtype).

Each `*_ref` is the reference the model's CPU path runs; the kernels match them to fp32 rounding.
The kernels have no backward: where autograd tracks an input (training), the references run.
"""

import torch

from ._triton import alloc, as_op, jit, next_pow2, tl, tracks_grad, use_triton


# ---- references ---------------------------------------------------------------------------------

def hc_mix_ref(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, sinkhorn_iters: int):
    """m [T, (2+n)n] fp32 mixing logits; base [(2+n)n]; scale [3]. Returns pre, post [T, n] and
    comb [T, n, n] (fp32); comb[j, k] weights input stream j into output stream k."""
    n = _streams(m.shape[-1])
    base, scale = base.float(), scale.float()
    m_pre, m_post, m_comb = m.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(m_pre * scale[0] + b_pre) + hc_eps
    post = 2 * torch.sigmoid(m_post * scale[1] + b_post)
    comb = torch.softmax((m_comb * scale[2] + b_comb).view(*m_comb.shape[:-1], n, n), dim=-1) + hc_eps
    # Sinkhorn: start and end with a column normalisation (sum over dim -2)
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse_ref(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Block input: sum_i pre_i X_i, computed in fp32 and cast to the stream dtype."""
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def hc_expand_ref(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: X_k <- post_k y + sum_j comb[j, k] X_j."""
    dt = streams.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


def _streams(width: int) -> int:
    """n from the logits' width (2 + n) n."""
    n = int((1 + width) ** 0.5) - 1
    assert (2 + n) * n == width, f"mixing logits of width {width} are not (2+n)n wide"
    return n


# ---- kernels --------------------------------------------------------------------------------------

@jit
def _hc_mix_kernel(m_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, hc_eps, iters,
                   N: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    W: tl.constexpr = (2 + N) * N
    i = tl.arange(0, N)
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    row = rows.to(tl.int64)[:, None] * W
    m_pre = tl.load(m_ptr + row + i[None, :], mask=live[:, None], other=0.0)
    pre = tl.sigmoid(m_pre * s_pre + tl.load(base_ptr + i)[None, :]) + hc_eps
    m_post = tl.load(m_ptr + row + N + i[None, :], mask=live[:, None], other=0.0)
    post = 2 * tl.sigmoid(m_post * s_post + tl.load(base_ptr + N + i)[None, :])
    out = rows.to(tl.int64)[:, None] * N + i[None, :]
    tl.store(pre_ptr + out, pre, mask=live[:, None])
    tl.store(post_ptr + out, post, mask=live[:, None])

    jk = 2 * N + i[:, None] * N + i[None, :]                                  # [N, N]: m's comb entries
    live3 = live[:, None, None]
    z = tl.load(m_ptr + rows.to(tl.int64)[:, None, None] * W + jk[None, :, :], mask=live3, other=0.0)
    z = z * s_comb + tl.load(base_ptr + jk)[None, :, :]
    z = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    c = z / tl.sum(z, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    nn = i[:, None] * N + i[None, :]
    tl.store(comb_ptr + rows.to(tl.int64)[:, None, None] * (N * N) + nn[None, :, :], c, mask=live3)


@jit
def _hc_collapse_kernel(x_ptr, pre_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    i = tl.arange(0, N)
    x = tl.load(x_ptr + t * N * D + i[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    p = tl.load(pre_ptr + t * N + i)
    tl.store(out_ptr + t * D + d, tl.sum(p[:, None] * x, axis=0).to(out_ptr.dtype.element_ty), mask=dm)


@jit
def _hc_expand_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    i = tl.arange(0, N)
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * N * D + i[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    for k in tl.static_range(N):
        pk = tl.load(post_ptr + t * N + k).to(dt).to(tl.float32)
        spread = (pk * y).to(dt).to(tl.float32)
        ck = tl.load(comb_ptr + t * N * N + i * N + k).to(dt).to(tl.float32)   # comb[:, k]
        mixed = tl.sum(ck[:, None] * x, axis=0).to(dt).to(tl.float32)
        tl.store(out_ptr + t * N * D + k * D + d, (spread + mixed).to(dt), mask=dm)


def hc_mix_triton(m, base, scale, hc_eps: float, sinkhorn_iters: int):
    n = _streams(m.shape[-1])
    lead = m.shape[:-1]
    m2 = m.reshape(-1, m.shape[-1]).float().contiguous()
    t = m2.shape[0]
    pre = alloc((*lead, n), torch.float32, m.device)
    post = alloc((*lead, n), torch.float32, m.device)
    comb = alloc((*lead, n, n), torch.float32, m.device)
    if t:
        block = 16
        _hc_mix_kernel[(_cdiv(t, block),)](m2, base.float().contiguous(), scale.float().contiguous(),
                                                 pre, post, comb, t, hc_eps, sinkhorn_iters, N=n, BLOCK_T=block)
    return pre, post, comb


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _block_d(d: int) -> int:
    return min(next_pow2(d), 1024)


def hc_collapse_triton(streams, pre):
    n, d = streams.shape[-2:]
    x = streams.contiguous()
    t = x.numel() // (n * d)
    out = alloc((*streams.shape[:-2], d), streams.dtype, streams.device)
    if t:
        block = _block_d(d)
        _hc_collapse_kernel[(t, _cdiv(d, block))](x, pre.float().contiguous(), out, d, N=n, BLOCK_D=block)
    return out


def hc_expand_triton(streams, y, post, comb):
    n, d = streams.shape[-2:]
    x = streams.contiguous()
    t = x.numel() // (n * d)
    out = alloc(streams.shape, streams.dtype, streams.device)
    if t:
        block = _block_d(d)
        _hc_expand_kernel[(t, _cdiv(d, block))](x, y.contiguous(), post.float().contiguous(),
                                                      comb.float().contiguous(), out, d, N=n, BLOCK_D=block)
    return out


# ---- dispatchers ---------------------------------------------------------------------------------

def hc_mix(m, base, scale, hc_eps: float, sinkhorn_iters: int, force_triton: bool = False):
    """hc_mix_ref's results; the Triton kernel for CUDA tensors (or `force_triton` in the interpreter)."""
    if as_op() and not tracks_grad(m, base, scale):
        return hc_mix_op(m, base, scale, hc_eps, sinkhorn_iters)
    if use_triton(m, force=force_triton) and _pow2(_streams(m.shape[-1])) and not tracks_grad(m, base, scale):
        return hc_mix_triton(m, base, scale, hc_eps, sinkhorn_iters)
    return hc_mix_ref(m, base, scale, hc_eps, sinkhorn_iters)


def hc_collapse(streams, pre, force_triton: bool = False):
    """hc_collapse_ref's result; the Triton kernel for CUDA tensors (n a power of two)."""
    if as_op() and not tracks_grad(streams, pre):
        return hc_collapse_op(streams, pre)
    if use_triton(streams, pre, force=force_triton) and _pow2(streams.shape[-2]) and not tracks_grad(streams, pre):
        return hc_collapse_triton(streams, pre)
    return hc_collapse_ref(streams, pre)


def hc_expand(streams, y, post, comb, force_triton: bool = False):
    """hc_expand_ref's result; the Triton kernel for CUDA tensors (n a power of two)."""
    if as_op() and not tracks_grad(streams, y, post, comb):
        return hc_expand_op(streams, y, post, comb)
    if (use_triton(streams, y, post, comb, force=force_triton) and _pow2(streams.shape[-2])
            and not tracks_grad(streams, y, post, comb)):
        return hc_expand_triton(streams, y, post, comb)
    return hc_expand_ref(streams, y, post, comb)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# The three as custom ops for compiled forwards (_triton's docstring).
@torch.library.custom_op("glm5mtp::hc_mix", mutates_args=())
def hc_mix_op(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
              sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if use_triton(m) and _pow2(_streams(m.shape[-1])):
        return hc_mix_triton(m, base, scale, hc_eps, sinkhorn_iters)
    return tuple(t.contiguous() for t in hc_mix_ref(m, base, scale, hc_eps, sinkhorn_iters))


@hc_mix_op.register_fake
def _(m, base, scale, hc_eps, sinkhorn_iters):
    n = _streams(m.shape[-1])
    lead = m.shape[:-1]
    return (m.new_empty((*lead, n), dtype=torch.float32), m.new_empty((*lead, n), dtype=torch.float32),
            m.new_empty((*lead, n, n), dtype=torch.float32))


@torch.library.custom_op("glm5mtp::hc_collapse", mutates_args=())
def hc_collapse_op(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    if use_triton(streams, pre) and _pow2(streams.shape[-2]):
        return hc_collapse_triton(streams, pre)
    return hc_collapse_ref(streams, pre).contiguous()


@hc_collapse_op.register_fake
def _(streams, pre):
    return streams.new_empty(streams.shape[:-2] + streams.shape[-1:])


@torch.library.custom_op("glm5mtp::hc_expand", mutates_args=())
def hc_expand_op(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if use_triton(streams, y, post, comb) and _pow2(streams.shape[-2]):
        return hc_expand_triton(streams, y, post, comb)
    return hc_expand_ref(streams, y, post, comb).contiguous()


@hc_expand_op.register_fake
def _(streams, y, post, comb):
    return streams.new_empty(streams.shape)
