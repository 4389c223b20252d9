"""mHC, GLM-5-Next's hyper-connections (models/glm5_next/mhc.py), as four kernels per block site (the
block's input norm among them).

PyTorch spends ~150 launches on one site: the Sinkhorn normalisation alone is two reductions and two
divisions per iteration over a [T, n, n] tensor (20 iterations in GLM-5-Next), and at decode every
one of them is a launch on a few hundred bytes. Here:

- `hc_weights`: the streams X [T, n, D] -> pre [T, n], post [T, n], comb [T, n, n] in two launches:
  the mixing logits and each row's sum of squares, split over the n D columns so a decode's few rows
  still spread over the GPU (the norm is a per-row scale, applied to the logits after the product);
  then the sigmoids, the row softmax and every Sinkhorn iteration in registers, one program per
  block of tokens. PyTorch's form is nine launches, one of them an fp32 GEMM;
- `hc_collapse`: the block input sum_i pre_i X_i (fp32 sum, cast to the stream dtype), and
  `hc_collapse_norm` the same followed by the block's RMSNorm (one program a row, two passes);
- `hc_expand`: the new streams X_k <- post_k y + sum_j comb[j, k] X_j, rounded where PyTorch's
  reference rounds (the product, the matmul, their sum, each once in the stream dtype).

Each `*_ref` is the reference the model's CPU path runs; the kernels match them to fp32 rounding.
The kernels have no backward: where autograd tracks an input (training), the references run.
"""

import torch
import torch.nn.functional as F

from ._triton import alloc, as_op, jit, next_pow2, tl, tracks_grad, use_triton
from .rmsnorm import rmsnorm_ref


# ---- references ---------------------------------------------------------------------------------

def hc_weights_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                   norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """Mixing weights of one HC site: streams [T, n, D]; fn [(2+n)n, nD]; base [(2+n)n]; scale [3].
    The flattened streams, RMS-normalised without a weight (norm_eps, not hc_eps), give the mixing
    logits fn @ x (fp32), then hc_mix_ref."""
    f = streams.reshape(*streams.shape[:-2], -1).float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + norm_eps)
    return hc_mix_ref(F.linear(f, fn.float()), base, scale, hc_eps, sinkhorn_iters)


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


def hc_collapse_norm_ref(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The block's normed input: kernels/rmsnorm.py's RMSNorm of hc_collapse_ref's result."""
    return rmsnorm_ref(hc_collapse_ref(streams, pre), weight, eps)


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
def _hc_logits_kernel(x_ptr, w_ptr, part_ptr, sq_ptr, T, K, SPLIT_K, W: tl.constexpr, WP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Partial logits x @ w^T and sums of squares of x over columns [s SPLIT_K, (s+1) SPLIT_K):
    part [splits, T, W], sq [splits, T] (fp32; x in the stream dtype, w fp32; the product's
    PRECISION as tl.dot's input_precision)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = tl.program_id(1)
    live = rows < T
    j = tl.arange(0, WP)
    acc = tl.zeros((BLOCK_T, WP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(s * SPLIT_K, (s + 1) * SPLIT_K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], mask=live[:, None] & km[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + j[:, None] * K + k[None, :], mask=(j < W)[:, None] & km[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        sq += tl.sum(x * x, axis=1)
    out = (s * T + rows).to(tl.int64)
    tl.store(part_ptr + out[:, None] * W + j[None, :], acc, mask=live[:, None] & (j < W)[None, :])
    tl.store(sq_ptr + out, sq, mask=live)


@jit
def _hc_mix_kernel(part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, splits, K, norm_eps,
                   hc_eps, iters, N: tl.constexpr, WP: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_S: tl.constexpr):
    """hc_mix_ref of the logits _hc_logits_kernel left in parts, each row scaled by its RMS norm."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < T
    W: tl.constexpr = (2 + N) * N
    # the column splits' partials, BLOCK_S splits a load: a decode row of Flash's width has 256 of
    # them, and one load after another took 37 us a site (H100)
    j = tl.arange(0, WP)
    s_in = tl.arange(0, BLOCK_S)
    m = tl.zeros((BLOCK_T, WP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + s_in
        at = s[:, None] * T + rows[None, :]                                  # [BLOCK_S, BLOCK_T]
        ok = (s < splits)[:, None] & live[None, :]
        sq += tl.sum(tl.load(sq_ptr + at, mask=ok, other=0.0), axis=0)
        m += tl.sum(tl.load(part_ptr + at.to(tl.int64)[:, :, None] * W + j[None, None, :],
                            mask=ok[:, :, None] & (j < W)[None, None, :], other=0.0), axis=0)
    m = m * tl.rsqrt(sq / K + norm_eps)[:, None]

    i = tl.arange(0, N)
    s_pre, s_post, s_comb = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    m_pre = _columns(m, j, i)
    pre = tl.sigmoid(m_pre * s_pre + tl.load(base_ptr + i)[None, :]) + hc_eps
    m_post = _columns(m, j, N + i)
    post = 2 * tl.sigmoid(m_post * s_post + tl.load(base_ptr + N + i)[None, :])
    out = rows.to(tl.int64)[:, None] * N + i[None, :]
    tl.store(pre_ptr + out, pre, mask=live[:, None])
    tl.store(post_ptr + out, post, mask=live[:, None])

    nn = tl.arange(0, N * N)                                                  # comb[j, k] at j N + k
    z = tl.reshape(_columns(m, j, 2 * N + nn), (BLOCK_T, N, N))
    z = z * s_comb + tl.reshape(tl.load(base_ptr + 2 * N + nn), (N, N))[None, :, :]
    live3 = live[:, None, None]
    z = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    c = z / tl.sum(z, axis=2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_ptr + rows.to(tl.int64)[:, None, None] * (N * N) + tl.reshape(nn, (N, N))[None, :, :], c,
             mask=live3)


@jit
def _columns(m, j, cols):
    """m[:, cols] of a register tile m [BLOCK_T, WP] whose columns are j: each picked entry plus zeros."""
    return tl.sum(tl.where(j[None, None, :] == cols[None, :, None], m[:, None, :], 0.0), axis=2)


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
def _hc_collapse_norm_kernel(x_ptr, pre_ptr, w_ptr, out_ptr, D, eps, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: the collapse (rounded to the stream dtype, as hc_collapse's output is), its sum of
    squares over D, then the collapse again, normalised and weighted (kernels/rmsnorm.py's rounding)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    p = tl.load(pre_ptr + t * N + i)
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + t * N * D + i[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0).to(tl.float32)
        h = tl.sum(p[:, None] * x, axis=0).to(dt).to(tl.float32)
        acc += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        x = tl.load(x_ptr + t * N * D + i[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
        h = tl.sum(p[:, None] * x, axis=0).to(dt).to(tl.float32)
        y = (h * rstd).to(dt).to(tl.float32) * tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + d, y.to(out_ptr.dtype.element_ty), mask=dm)


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


LOGITS_BLOCK_T, LOGITS_BLOCK_K = 16, 64
# the logits' fp32 product on tensor cores as three TF32 products (a hi/lo split of each operand; a
# bf16 x has no lo part): fp32's accuracy to about 2^-22 a term, where "ieee" runs it on the CUDA
# cores, which a prefill's thousands of rows made the admission's largest kernel
LOGITS_PRECISION = "tf32x3"
MIX_BLOCK_T, MIX_BLOCK_S = 1, 32


def _logit_splits(t: int, k: int, device) -> tuple[int, int]:
    """Column splits of the logits and the columns each takes: about two programs per SM, at least
    one block of columns each, none empty."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    splits = max(1, min(_cdiv(k, LOGITS_BLOCK_K), _cdiv(2 * sms, _cdiv(t, LOGITS_BLOCK_T))))
    per_split = _cdiv(_cdiv(k, splits), LOGITS_BLOCK_K) * LOGITS_BLOCK_K
    return _cdiv(k, per_split), per_split


def hc_weights_triton(streams, fn, base, scale, norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    n, d = streams.shape[-2:]
    lead = streams.shape[:-2]
    x = streams.reshape(-1, n * d).contiguous()
    t, k, width = x.shape[0], n * d, fn.shape[0]
    pre = alloc((*lead, n), torch.float32, streams.device)
    post = alloc((*lead, n), torch.float32, streams.device)
    comb = alloc((*lead, n, n), torch.float32, streams.device)
    if t:
        splits, per_split = _logit_splits(t, k, streams.device)
        part = torch.empty(splits, t, width, dtype=torch.float32, device=streams.device)
        sq = torch.empty(splits, t, dtype=torch.float32, device=streams.device)
        _hc_logits_kernel[(_cdiv(t, LOGITS_BLOCK_T), splits)](
            x, fn.float().contiguous(), part, sq, t, k, per_split, W=width, WP=next_pow2(width),
            BLOCK_T=LOGITS_BLOCK_T, BLOCK_K=LOGITS_BLOCK_K, PRECISION=LOGITS_PRECISION)
        # one row a program on one warp: the Sinkhorn iterations' reductions stay inside it, and a row
        # sums its 32-split blocks alone (a decode row of Flash's width: 6.5 us against 8.4 us on four
        # warps and 17 us at 4 rows a program, H100; kernels/RESULTS.md)
        _hc_mix_kernel[(_cdiv(t, MIX_BLOCK_T),)](part, sq, base.float().contiguous(), scale.float().contiguous(),
                                                 pre, post, comb, t, splits, k, norm_eps, hc_eps, sinkhorn_iters,
                                                 N=n, WP=next_pow2(width), BLOCK_T=MIX_BLOCK_T, BLOCK_S=MIX_BLOCK_S,
                                                 num_warps=1)
    return pre, post, comb


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _block_d(d: int) -> int:
    return min(next_pow2(d), 1024)


def _row_warps(block: int) -> int:
    """Warps for a [n, block] row tile: one per 256 columns. Four warps on a 256-wide tile (glm5next-nano)
    took 2-18x one warp's time in collapse-norm and expand (H100, 1 to 1024 rows); at 1024 wide four
    warps are the faster."""
    return max(1, min(4, block // 256))


def hc_collapse_triton(streams, pre):
    n, d = streams.shape[-2:]
    x = streams.contiguous()
    t = x.numel() // (n * d)
    out = alloc((*streams.shape[:-2], d), streams.dtype, streams.device)
    if t:
        block = _block_d(d)
        _hc_collapse_kernel[(t, _cdiv(d, block))](x, pre.float().contiguous(), out, d, N=n, BLOCK_D=block)
    return out


def hc_collapse_norm_triton(streams, pre, weight, eps: float):
    n, d = streams.shape[-2:]
    x = streams.contiguous()
    t = x.numel() // (n * d)
    out = alloc((*streams.shape[:-2], d), torch.promote_types(streams.dtype, weight.dtype), streams.device)
    if t:
        block = _block_d(d)
        _hc_collapse_norm_kernel[(t,)](x, pre.float().contiguous(), weight.contiguous(), out, d, eps, N=n,
                                       BLOCK_D=block, num_warps=_row_warps(block))
    return out


def hc_expand_triton(streams, y, post, comb):
    n, d = streams.shape[-2:]
    x = streams.contiguous()
    t = x.numel() // (n * d)
    out = alloc(streams.shape, streams.dtype, streams.device)
    if t:
        block = _block_d(d)
        _hc_expand_kernel[(t, _cdiv(d, block))](x, y.contiguous(), post.float().contiguous(),
                                                      comb.float().contiguous(), out, d, N=n, BLOCK_D=block,
                                                      num_warps=_row_warps(block))
    return out


# ---- dispatchers ---------------------------------------------------------------------------------

def hc_weights(streams, fn, base, scale, norm_eps: float, hc_eps: float, sinkhorn_iters: int,
               force_triton: bool = False):
    """hc_weights_ref's results; the Triton kernels for CUDA tensors (or `force_triton` in the interpreter)."""
    args = (streams, fn, base, scale)
    if as_op() and not tracks_grad(*args):
        return hc_weights_op(*args, norm_eps, hc_eps, sinkhorn_iters)
    if use_triton(*args, force=force_triton) and _pow2(streams.shape[-2]) and not tracks_grad(*args):
        return hc_weights_triton(*args, norm_eps, hc_eps, sinkhorn_iters)
    return hc_weights_ref(*args, norm_eps, hc_eps, sinkhorn_iters)


def hc_collapse(streams, pre, force_triton: bool = False):
    """hc_collapse_ref's result; the Triton kernel for CUDA tensors (n a power of two)."""
    if as_op() and not tracks_grad(streams, pre):
        return hc_collapse_op(streams, pre)
    if use_triton(streams, pre, force=force_triton) and _pow2(streams.shape[-2]) and not tracks_grad(streams, pre):
        return hc_collapse_triton(streams, pre)
    return hc_collapse_ref(streams, pre)


def hc_collapse_norm(streams, pre, weight, eps: float, force_triton: bool = False):
    """hc_collapse_norm_ref's result (the block input, normed); one Triton kernel for CUDA tensors."""
    if as_op() and not tracks_grad(streams, pre, weight):
        return hc_collapse_norm_op(streams, pre, weight, eps)
    if (use_triton(streams, pre, weight, force=force_triton) and _pow2(streams.shape[-2])
            and not tracks_grad(streams, pre, weight)):
        return hc_collapse_norm_triton(streams, pre, weight, eps)
    return hc_collapse_norm_ref(streams, pre, weight, eps)


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
@torch.library.custom_op("glm5mtp::hc_weights", mutates_args=())
def hc_weights_op(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                  hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = (streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    if use_triton(streams, fn, base, scale) and _pow2(streams.shape[-2]):
        return hc_weights_triton(*args)
    return tuple(t.contiguous() for t in hc_weights_ref(*args))


@hc_weights_op.register_fake
def _(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    n, lead = streams.shape[-2], streams.shape[:-2]
    return (streams.new_empty((*lead, n), dtype=torch.float32), streams.new_empty((*lead, n), dtype=torch.float32),
            streams.new_empty((*lead, n, n), dtype=torch.float32))


@torch.library.custom_op("glm5mtp::hc_collapse", mutates_args=())
def hc_collapse_op(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    if use_triton(streams, pre) and _pow2(streams.shape[-2]):
        return hc_collapse_triton(streams, pre)
    return hc_collapse_ref(streams, pre).contiguous()


@hc_collapse_op.register_fake
def _(streams, pre):
    return streams.new_empty(streams.shape[:-2] + streams.shape[-1:])


@torch.library.custom_op("glm5mtp::hc_collapse_norm", mutates_args=())
def hc_collapse_norm_op(streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(streams, pre, weight) and _pow2(streams.shape[-2]):
        return hc_collapse_norm_triton(streams, pre, weight, eps)
    return hc_collapse_norm_ref(streams, pre, weight, eps).contiguous()


@hc_collapse_norm_op.register_fake
def _(streams, pre, weight, eps):
    return streams.new_empty(streams.shape[:-2] + streams.shape[-1:], dtype=torch.promote_types(streams.dtype, weight.dtype))


@torch.library.custom_op("glm5mtp::hc_expand", mutates_args=())
def hc_expand_op(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if use_triton(streams, y, post, comb) and _pow2(streams.shape[-2]):
        return hc_expand_triton(streams, y, post, comb)
    return hc_expand_ref(streams, y, post, comb).contiguous()


@hc_expand_op.register_fake
def _(streams, y, post, comb):
    return streams.new_empty(streams.shape)
