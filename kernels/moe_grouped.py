"""Routed experts of a MoE layer for many (token, expert) pairs: prefill and wide batches.

Same result as :func:`kernels.moe.moe_experts_ref` (and its FP8 twin), computed as a grouped GEMM:
the N*K pairs are sorted by expert and each expert's pairs cut into blocks of BLOCK_M rows, so a
program reads one expert's weight tile once for up to BLOCK_M tokens. kernels/moe.py's GEMV kernels
read the expert once per pair instead: right for a decode step (a pair per expert), wasteful when
many tokens share an expert, and the looped PyTorch path (models/glm5/layers.Experts._looped)
costs a host sync plus ~12 launches per hit expert, which made an eager glm5-nano prefill forward
host-bound on the H200 (profiles/glm5-nano/bench_h200/offline_engine/run5_prefill_profile.txt).

The block plan is built on the device with fixed shapes (no host sync: the launch can be captured
in a CUDA graph): a grid of min(P, ceil(P / BLOCK_M) + E) blocks, the most any routing of P pairs
over E experts needs; block b names its expert, its first sorted pair and its row count, 0 for a
block past the last expert's (the program returns at once). An id equal to E marks a pair owned by
another rank (expert parallel): it is sorted last and never planned, and its output stays zero.

Per block, two kernels with the reference's roundings (every product rounded to x.dtype):
1. grid (blocks, I / BLOCK_N): g = x @ gate[e]^T and u = x @ up[e]^T over H (fp32 accumulation),
   the optional SwiGLU clamp (GLM-5-Next), h = silu(g) * u, stored at the pair's sorted position;
2. grid (blocks, H / BLOCK_N): y[pair] = (h @ down[e]^T) * weight; torch sums y over K.
FP8 stacks: the tiles lie inside one 128x128 scale block, so each partial product is scaled by
that block's scale (a scalar per tile step), the weights read one byte each.
"""

from __future__ import annotations

import torch

from ._triton import as_op, interpreting, jit, next_pow2, tl, triton, use_triton
from .moe import _round, moe_experts_fp8_ref, moe_experts_ref

BLOCK_N = 64  # output columns per program and reduction columns per step (divides the 128-wide FP8 scale block)
NUM_WARPS = 4


def block_rows(pairs: int, n_experts: int) -> int:
    """BLOCK_M: rows per block from the mean pairs per expert (16, the smallest tl.dot side, to 64)."""
    mean = pairs / max(n_experts, 1)
    return 16 if mean <= 16 else (32 if mean <= 48 else 64)


def pays(pairs: int, n_experts: int) -> bool:
    """Whether the grouped kernels beat the per-pair GEMV: once an expert is expected to serve
    more than two pairs (shape-only, so the choice is the same at capture and at replay)."""
    return pairs > 2 * n_experts


def plan_blocks(ids: torch.Tensor, n_experts: int, block_m: int):
    """(order, expert, first, rows) for the kernels' grid (module docstring): order[s] is the pair
    at sorted position s; per block its expert, first sorted position and row count."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: CUDA's bincount reads the largest id on the host
    counts = torch.zeros(n_experts + 1, dtype=torch.long, device=flat.device)
    counts = counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.long))[:n_experts]  # id E: another rank's pair
    starts = torch.cumsum(counts, 0) - counts
    nblocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(nblocks, 0)
    grid = min(pairs, -(-pairs // block_m) + n_experts)
    b = torch.arange(grid, device=flat.device)
    expert = torch.searchsorted(ends, b, right=True)
    e = expert.clamp(max=n_experts - 1)
    local = b - (ends[e] - nblocks[e])
    rows = torch.where(expert < n_experts, (counts[e] - local * block_m).clamp(0, block_m), 0)
    return order, e, starts[e] + local * block_m, rows


@jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, gs_ptr, us_ptr, order_ptr, expert_ptr, first_ptr, rows_ptr, h_ptr,
                    K, limit, H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SB: tl.constexpr, CLAMP: tl.constexpr, DOT_BF16: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.load(rows_ptr + b)
    if rows == 0:
        return
    e = tl.load(expert_ptr + b).to(tl.int64)
    first = tl.load(first_ptr + b)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < rows
    pair = tl.load(order_ptr + first + offs_m, mask=mmask, other=0)
    token = (pair // K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < I
    w_rows = e * (I * H) + offs_n[None, :].to(tl.int64) * H  # [1, BLOCK_N] row starts of gate/up[e]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < H
        xa = tl.load(x_ptr + token[:, None] * H + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wm = kmask[:, None] & nmask[None, :]
        gw = tl.load(gate_ptr + w_rows + cols[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
        uw = tl.load(up_ptr + w_rows + cols[:, None], mask=wm, other=0.0)
        if DOT_BF16:
            pg = tl.dot(xa.to(tl.bfloat16), gw.to(tl.bfloat16))
            pu = tl.dot(xa.to(tl.bfloat16), uw.to(tl.bfloat16))
        else:
            pg = tl.dot(xa.to(tl.float32), gw.to(tl.float32), input_precision="ieee")
            pu = tl.dot(xa.to(tl.float32), uw.to(tl.float32), input_precision="ieee")
        if SB > 0:  # this tile's scale: one block of expert e's [I/SB, H/SB] grid
            s_at = e * (tl.cdiv(I, SB) * tl.cdiv(H, SB)) + ((tl.program_id(1) * BLOCK_N) // SB) * tl.cdiv(H, SB) + k0 // SB
            pg = pg * tl.load(gs_ptr + s_at)
            pu = pu * tl.load(us_ptr + s_at)
        acc_g += pg
        acc_u += pu
    g = _round(acc_g, h_ptr)
    u = _round(acc_u, h_ptr)
    if CLAMP:  # GLM-5-Next: gate from above, up both ways (layers.swiglu)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = _round(g / (1.0 + tl.exp(-g)), h_ptr)
    h = _round(act * u, h_ptr)
    at = (first + offs_m).to(tl.int64)  # sorted positions
    tl.store(h_ptr + at[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@jit
def _down_kernel(h_ptr, down_ptr, ds_ptr, order_ptr, expert_ptr, first_ptr, rows_ptr, w_ptr, y_ptr,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SB: tl.constexpr, DOT_BF16: tl.constexpr):
    b = tl.program_id(0)
    rows = tl.load(rows_ptr + b)
    if rows == 0:
        return
    e = tl.load(expert_ptr + b).to(tl.int64)
    first = tl.load(first_ptr + b)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < rows
    at = (first + offs_m).to(tl.int64)
    pair = tl.load(order_ptr + at, mask=mmask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    w_rows = e * (H * I) + offs_n[None, :].to(tl.int64) * I  # row starts of down[e]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < I
        ha = tl.load(h_ptr + at[:, None] * I + cols[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        dw = tl.load(down_ptr + w_rows + cols[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_BF16:
            part = tl.dot(ha.to(tl.bfloat16), dw.to(tl.bfloat16))
        else:
            part = tl.dot(ha.to(tl.float32), dw.to(tl.float32), input_precision="ieee")
        if SB > 0:
            part = part * tl.load(ds_ptr + e * (tl.cdiv(H, SB) * tl.cdiv(I, SB))
                                  + ((tl.program_id(1) * BLOCK_N) // SB) * tl.cdiv(I, SB) + k0 // SB)
        acc += part
    out = _round(acc, y_ptr)  # the expert output in x.dtype
    wt = _round(tl.load(w_ptr + pair, mask=mmask, other=0.0).to(tl.float32), y_ptr)
    tl.store(y_ptr + pair[:, None] * H + offs_n[None, :], _round(out * wt[:, None], y_ptr).to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def moe_experts_grouped_triton(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                               weights: torch.Tensor, ids: torch.Tensor, limit: float | None = None,
                               scales: tuple | None = None, block: int = 0) -> torch.Tensor:
    """Both kernels over the sorted blocks; `scales` (gate, up, down grids) with `block` for FP8 stacks."""
    n, hid = x.shape
    e_count, inter, _ = gate.shape
    assert gate.shape == up.shape == (e_count, inter, hid) and down.shape == (e_count, hid, inter), \
        f"gate/up {tuple(gate.shape)}, down {tuple(down.shape)} for H={hid}"
    assert x.is_contiguous() and gate.is_contiguous() and up.is_contiguous() and down.is_contiguous()
    assert ids.dim() == 2 and ids.shape[0] == n and weights.shape == ids.shape
    k = ids.shape[1]
    pairs = n * k
    y = torch.zeros(pairs, hid, dtype=x.dtype, device=x.device)  # pairs of other ranks stay zero
    if pairs and hid and inter:
        # FP8: a tile never straddles two scale blocks (GLM-5-FP8's 128, or a test's 32)
        tile = min(BLOCK_N, block) if block else BLOCK_N
        assert not block or (block % tile == 0 and tile >= 16), f"scale block {block}: a power of two >= 16"
        block_m = block_rows(pairs, e_count)
        order, expert, first, rows = plan_blocks(ids, e_count, block_m)
        h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
        gs, us, ds = scales if scales is not None else (x, x, x)  # unused without scales
        dot_bf16 = x.dtype == torch.bfloat16 and not interpreting()
        grid = rows.numel()
        _gate_up_kernel[(grid, triton.cdiv(inter, tile))](
            x, gate, up, gs, us, order, expert, first, rows, h, k, float(limit or 0.0), H=hid, I=inter,
            BLOCK_M=block_m, BLOCK_N=tile, BLOCK_K=min(tile, next_pow2(hid)), SB=block,
            CLAMP=limit is not None, DOT_BF16=dot_bf16, num_warps=NUM_WARPS)
        _down_kernel[(grid, triton.cdiv(hid, tile))](
            h, down, ds, order, expert, first, rows, weights.reshape(-1).contiguous(), y, H=hid, I=inter,
            BLOCK_M=block_m, BLOCK_N=tile, BLOCK_K=min(tile, next_pow2(inter)), SB=block,
            DOT_BF16=dot_bf16, num_warps=NUM_WARPS)
    return y.view(n, k, hid).sum(1)


def moe_experts_grouped_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                            weights: torch.Tensor, ids: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """PyTorch reference: kernels/moe.moe_experts_ref, with id E (another rank's pair) contributing zero."""
    e_count = gate.shape[0]
    return moe_experts_ref(x, gate, up, down, weights * (ids < e_count), ids.clamp(max=e_count - 1), limit)


def moe_experts_grouped(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, limit: float | None = None,
                        force_triton: bool = False) -> torch.Tensor:
    """Weighted sum of each token's routed SwiGLU experts (clamped at `limit` when given) for many
    pairs; ids in 0..E (E: another rank's pair, contributes zero). Returns [N, H] in x.dtype."""
    if as_op():
        return moe_experts_grouped_op(x, gate, up, down, weights, ids, limit)
    if use_triton(x, gate, up, down, weights, ids, force=force_triton):
        assert gate.dtype == up.dtype == down.dtype == x.dtype, "x and the expert weights must share a dtype"
        return moe_experts_grouped_triton(x, gate, up, down, weights, ids, limit)
    return moe_experts_grouped_ref(x, gate, up, down, weights, ids, limit)


def moe_experts_grouped_fp8(x: torch.Tensor, gate: torch.Tensor, gate_s: torch.Tensor, up: torch.Tensor,
                            up_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, weights: torch.Tensor,
                            ids: torch.Tensor, block: int = 128, limit: float | None = None,
                            force_triton: bool = False) -> torch.Tensor:
    """:func:`moe_experts_grouped` over FP8 stacks with their fp32 scale grids (kernels/moe.py's
    layout). The reference dequantizes the chosen experts (fp32 products, then x.dtype)."""
    if as_op():
        return moe_experts_grouped_fp8_op(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, limit)
    if use_triton(x, gate, up, down, weights, ids, force=force_triton):
        return moe_experts_grouped_triton(x, gate, up, down, weights, ids, limit, (gate_s, up_s, down_s), block)
    return _grouped_fp8_ref(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, limit)


def _grouped_fp8_ref(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, limit):
    """kernels/moe.moe_experts_fp8_ref (the chosen experts dequantized), id E contributing zero."""
    e_count = gate.shape[0]
    return moe_experts_fp8_ref(x, gate, gate_s, up, up_s, down, down_s, weights * (ids < e_count),
                               ids.clamp(max=e_count - 1), block, limit)

# The dispatchers as custom ops for compiled forwards (kernels/_triton.py's docstring).
@torch.library.custom_op("glm5mtp::moe_experts_grouped", mutates_args=())
def moe_experts_grouped_op(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                           weights: torch.Tensor, ids: torch.Tensor, limit: float | None) -> torch.Tensor:
    if use_triton(x, gate, up, down, weights, ids):
        return moe_experts_grouped_triton(x, gate, up, down, weights, ids, limit)
    return moe_experts_grouped_ref(x, gate, up, down, weights, ids, limit)


@moe_experts_grouped_op.register_fake
def _(x, gate, up, down, weights, ids, limit):
    return x.new_empty(x.shape)


@torch.library.custom_op("glm5mtp::moe_experts_grouped_fp8", mutates_args=())
def moe_experts_grouped_fp8_op(x: torch.Tensor, gate: torch.Tensor, gate_s: torch.Tensor, up: torch.Tensor,
                               up_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, weights: torch.Tensor,
                               ids: torch.Tensor, block: int, limit: float | None) -> torch.Tensor:
    if use_triton(x, gate, up, down, weights, ids):
        return moe_experts_grouped_triton(x, gate, up, down, weights, ids, limit, (gate_s, up_s, down_s), block)
    return _grouped_fp8_ref(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, limit)


@moe_experts_grouped_fp8_op.register_fake
def _(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, limit):
    return x.new_empty(x.shape)
