"""Routed experts of a MoE layer for few tokens (decode, verify and draft steps).

Each token n picks K experts ``ids[n]`` with routing weights ``weights[n]``; expert e is a SwiGLU
MLP with stacked weights ``gate[e], up[e]`` [I, H] and ``down[e]`` [H, I]::

    h[n, k]   = silu(x[n] @ gate[e]^T) * (x[n] @ up[e]^T)        e = ids[n, k]
    out[n]    = sum_k (h[n, k] @ down[e]^T) * weights[n, k]

With ``swiglu_limit`` L (GLM-5-Next: 10) the two products are clamped first, as the model's
``swiglu`` does: the gate product from above only (min(g, L)), the up product to [-L, L].

The reference is what ``Experts._gathered`` of ``glm5mtp_cli/models/glm5/layers.py`` computes: it
gathers the chosen experts' weights (a copy of K experts per token) and rounds every intermediate
(gate and up products, silu, h, the expert output, its product with the weight) to ``x.dtype``.

The Triton path reads each chosen expert's rows straight out of the stacked tensors, with no
gathered copy, in two GEMV kernels over the N*K (token, expert) pairs:

1. grid (pairs, I / BLOCK_I): the gate and up dot products of BLOCK_I rows, streamed over H in
   BLOCK_H-wide tiles (fp32 accumulation), then ``h = silu(g) * u`` with the reference's
   roundings (and its clamp: a compile-time LIMIT, 0 for none), stored in ``x.dtype``;
2. grid (pairs, H / BLOCK_O): ``y[p] = (h[p] @ down[e]^T)`` rounded to ``x.dtype``, times the
   weight cast to ``x.dtype``; torch then sums y over K (deterministic, no atomics).

No host sync and no data-dependent shape: the launch can be captured in a CUDA graph.

FP8 experts (GLM-5-FP8: float8_e4m3fn stacks with one fp32 ``scale_inv`` per 128x128 block of each
expert, [E, ceil(rows/b), ceil(cols/b)]): :func:`moe_experts_fp8` reads the same stacks in place.
A program's rows lie in one scale block (BLOCK_I and BLOCK_O divide the block), so the kernels
multiply the activation tile by that block row's scales once per step instead of scaling every
weight: the weight loads stay one byte each. Its reference dequantizes the chosen experts (fp32
products, then rounded to ``x.dtype``: the weights an unquantized twin holds) and runs
:func:`moe_experts_ref`.
"""

import torch

from ._triton import alloc, as_op, jit, next_pow2, tl, triton, use_triton
from .fp8_block import fp8_block_dequant_ref

# GEMV tiles. Both kernels are memory bound (GLM-5: H = 6144, I = 2048, bf16, 25 MB per expert
# matrix): each program streams a contiguous [rows x 256] weight tile per step (512-byte row
# segments in bf16), and a decode step of 8 pairs already launches 8 * 2048/16 = 1024 programs
# for kernel 1 and 8 * 6144/32 = 1536 for kernel 2, several per H200 multiprocessor (132).
# Compiled offline for sm_90 (bf16): 16-byte vector loads, no spills, 155 / 123 registers per
# thread. Not yet timed on a GPU: `python -m kernels.bench` has the moe_experts cases.
BLOCK_I = 16  # kernel 1: rows of gate/up per program
BLOCK_H = 256  # kernel 1: columns (over H) per step
BLOCK_O = 32  # kernel 2: rows of down per program
BLOCK_K = 256  # kernel 2: columns (over I) per step
NUM_WARPS = 4


def _experts_ref(x, g, u, d, weights, swiglu_limit):
    """The chosen experts' weights g, u [N, K, I, H] and d [N, K, H, I] applied; [N, H] in x.dtype."""
    gx, ux = torch.einsum("nh,nkih->nki", x, g), torch.einsum("nh,nkih->nki", x, u)
    if swiglu_limit is not None:
        gx, ux = gx.clamp(max=swiglu_limit), ux.clamp(-swiglu_limit, swiglu_limit)
    out = torch.einsum("nki,nkhi->nkh", torch.nn.functional.silu(gx) * ux, d)
    return (out * weights.unsqueeze(-1).to(out.dtype)).sum(1)


def moe_experts_ref(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """PyTorch reference: gathers the chosen experts' weights; returns [N, H] in x.dtype."""
    return _experts_ref(x, gate[ids], up[ids], down[ids], weights, swiglu_limit)


@jit
def _round(v, ref_ptr):
    """fp32 `v` rounded (to nearest even) to the element type of `ref_ptr`, returned as fp32.

    bf16 is rounded with integer ops on the fp32 bits: the same as the compiled conversion, and
    right in the interpreter too, whose fp32 -> bf16 cast truncates (each truncation shrinks the
    value by up to one ulp, and this kernel rounds six times in a row).
    """
    if ref_ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(ref_ptr.dtype.element_ty).to(tl.float32)


@jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, ids_ptr, h_ptr, gs_ptr, us_ptr, K,
                    H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    SB: tl.constexpr, LIMIT: tl.constexpr):
    # SB: the FP8 scale block (0: unscaled weights in x.dtype; gs_ptr/us_ptr are then unused);
    # LIMIT: the swiglu clamp (0: none)
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    token = p // K
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_h = tl.arange(0, BLOCK_H)
    imask = offs_i < I
    rows = e * (I * H) + offs_i[:, None].to(tl.int64) * H  # row starts in the stacked [E, I, H]
    x_row = x_ptr + token.to(tl.int64) * H
    if SB > 0:  # this program's rows share one block row of each expert's [I/SB, H/SB] scale grid
        s_row = e * (tl.cdiv(I, SB) * tl.cdiv(H, SB)) + ((tl.program_id(1) * BLOCK_I) // SB) * tl.cdiv(H, SB)
    acc_g = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + offs_h
        hmask = cols < H
        xv = tl.load(x_row + cols, mask=hmask, other=0.0).to(tl.float32)
        xg = xv
        xu = xv
        if SB > 0:
            xg = xv * tl.load(gs_ptr + s_row + cols // SB, mask=hmask, other=0.0)
            xu = xv * tl.load(us_ptr + s_row + cols // SB, mask=hmask, other=0.0)
        m = imask[:, None] & hmask[None, :]
        gw = tl.load(gate_ptr + rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        uw = tl.load(up_ptr + rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += gw * xg[None, :]
        acc_u += uw * xu[None, :]
    # the reference rounds each product to x.dtype, silu's result too, then their product
    g = _round(tl.sum(acc_g, axis=1), h_ptr)
    u = _round(tl.sum(acc_u, axis=1), h_ptr)
    if LIMIT > 0:  # the reference clamps the rounded products in x.dtype (a limit rounds as it would)
        g = _round(tl.minimum(g, LIMIT), h_ptr)
        u = _round(tl.minimum(tl.maximum(u, -LIMIT), LIMIT), h_ptr)
    act = _round(g / (1.0 + tl.exp(-g)), h_ptr)
    tl.store(h_ptr + p.to(tl.int64) * I + offs_i, _round(act * u, h_ptr).to(h_ptr.dtype.element_ty), mask=imask)


@jit
def _down_kernel(h_ptr, down_ptr, ids_ptr, w_ptr, y_ptr, ds_ptr,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, SB: tl.constexpr):
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = tl.arange(0, BLOCK_K)
    omask = offs_o < H
    rows = e * (H * I) + offs_o[:, None].to(tl.int64) * I  # row starts in the stacked [E, H, I]
    h_row = h_ptr + p.to(tl.int64) * I
    if SB > 0:
        s_row = e * (tl.cdiv(H, SB) * tl.cdiv(I, SB)) + ((tl.program_id(1) * BLOCK_O) // SB) * tl.cdiv(I, SB)
    acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + offs_k
        kmask = cols < I
        hv = tl.load(h_row + cols, mask=kmask, other=0.0).to(tl.float32)
        if SB > 0:
            hv = hv * tl.load(ds_ptr + s_row + cols // SB, mask=kmask, other=0.0)
        dw = tl.load(down_ptr + rows + cols[None, :], mask=omask[:, None] & kmask[None, :], other=0.0)
        acc += dw.to(tl.float32) * hv[None, :]
    out = _round(tl.sum(acc, axis=1), y_ptr)  # the expert output in x.dtype
    wt = _round(tl.load(w_ptr + p).to(tl.float32), y_ptr)  # the weight cast to x.dtype
    tl.store(y_ptr + p.to(tl.int64) * H + offs_o, _round(out * wt, y_ptr).to(y_ptr.dtype.element_ty), mask=omask)


def _launch(x, gate, up, down, weights, ids, scales=None, block: int = 0,
            swiglu_limit: float | None = None) -> torch.Tensor:
    """Both kernels over the N*K (token, expert) pairs; `scales` (gate, up, down scale grids) with
    `block` for FP8 stacks; `swiglu_limit` clamps the gate/up products (None: no clamp)."""
    assert swiglu_limit is None or swiglu_limit > 0, f"swiglu_limit {swiglu_limit} must be positive"
    n, hid = x.shape
    e_count, inter, _ = gate.shape
    assert gate.shape == up.shape == (e_count, inter, hid), f"gate/up {tuple(gate.shape)}, {tuple(up.shape)}"
    assert down.shape == (e_count, hid, inter), f"down {tuple(down.shape)} should be {(e_count, hid, inter)}"
    assert x.is_contiguous() and gate.is_contiguous() and up.is_contiguous() and down.is_contiguous(), \
        "x and the stacked expert weights must be contiguous"
    assert ids.dim() == 2 and ids.shape[0] == n and weights.shape == ids.shape, \
        f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} should both be [{n}, K]"
    assert not ids.is_floating_point() and weights.is_floating_point()
    k = ids.shape[1]
    pairs = n * k
    ids_flat = ids.reshape(-1).contiguous()  # no copy for the router's contiguous output
    w_flat = weights.reshape(-1).contiguous()
    h = alloc((pairs, inter), dtype=x.dtype, device=x.device)
    y = alloc((pairs, hid), dtype=x.dtype, device=x.device)
    gs, us, ds = scales if scales is not None else (x, x, x)  # unused without scales
    if pairs and hid and inter:
        block_i, block_h = min(BLOCK_I, next_pow2(inter)), min(BLOCK_H, next_pow2(hid))
        block_o, block_k = min(BLOCK_O, next_pow2(hid)), min(BLOCK_K, next_pow2(inter))
        assert not block or (block % block_i == 0 and block % block_o == 0), \
            f"scale block {block} must be a multiple of {block_i} and {block_o}"
        _gate_up_kernel[(pairs, triton.cdiv(inter, block_i))](
            x, gate, up, ids_flat, h, gs, us, k, H=hid, I=inter, BLOCK_I=block_i, BLOCK_H=block_h, SB=block,
            LIMIT=float(swiglu_limit or 0.0), num_warps=NUM_WARPS)
        _down_kernel[(pairs, triton.cdiv(hid, block_o))](
            h, down, ids_flat, w_flat, y, ds, H=hid, I=inter, BLOCK_O=block_o, BLOCK_K=block_k, SB=block,
            num_warps=NUM_WARPS)
    elif pairs:
        y.zero_()  # I == 0: every expert outputs zeros
    return y.view(n, k, hid).sum(1)


def moe_experts_triton(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """Triton version of :func:`moe_experts_ref` (same arguments and result), see the module docstring.

    H and I are compile-time constants (one compilation per model's dimensions), so the loops over
    them have static bounds.
    """
    assert gate.dtype == up.dtype == down.dtype == x.dtype, "x and the expert weights must share a dtype"
    return _launch(x, gate, up, down, weights, ids, swiglu_limit=swiglu_limit)


def moe_experts_fp8_ref(x: torch.Tensor, gate: torch.Tensor, gate_s: torch.Tensor, up: torch.Tensor,
                        up_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, block: int = 128, swiglu_limit: float | None = None) -> torch.Tensor:
    """PyTorch reference: the chosen experts dequantized (fp32, then x.dtype), then moe_experts_ref's math."""
    def pick(w, s):
        return fp8_block_dequant_ref(w[ids], s[ids], block, torch.float32).to(x.dtype)  # [N, K, rows, cols]

    return _experts_ref(x, pick(gate, gate_s), pick(up, up_s), pick(down, down_s), weights, swiglu_limit)


def moe_experts_fp8_triton(x: torch.Tensor, gate: torch.Tensor, gate_s: torch.Tensor, up: torch.Tensor,
                           up_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, block: int = 128, swiglu_limit: float | None = None) -> torch.Tensor:
    """Triton version of :func:`moe_experts_fp8_ref`: the FP8 stacks and their scale grids read in place."""
    fp8 = torch.float8_e4m3fn
    assert gate.dtype == up.dtype == down.dtype == fp8, "FP8 experts are float8_e4m3fn stacks"
    for w, s in ((gate, gate_s), (up, up_s), (down, down_s)):
        rows, cols = w.shape[1:]
        want = (w.shape[0], -(-rows // block), -(-cols // block))
        assert tuple(s.shape) == want and s.dtype == torch.float32 and s.is_contiguous(), \
            f"scale grid {tuple(s.shape)} ({s.dtype}) should be {want} fp32, contiguous"
    return _launch(x, gate, up, down, weights, ids, (gate_s, up_s, down_s), block, swiglu_limit)


def moe_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None = None,
                force_triton: bool = False) -> torch.Tensor:
    """Weighted sum of each token's routed SwiGLU experts, read from the stacked weights.

    Args:
        x: [N, H] activations.
        gate, up: [E, I, H] stacked expert weights (contiguous, x.dtype on the Triton path).
        down: [E, H, I] stacked expert weights.
        weights: [N, K] routing weights (fp32).
        ids: [N, K] expert ids in 0..E-1 (int64 or int32).
        swiglu_limit: clamp of the gate (above) and up (both sides) products, None for none.
        force_triton: run the Triton kernels in the interpreter (tests only).
    Returns:
        [N, H] in x.dtype.
    """
    if as_op():
        return moe_experts_op(x, gate, up, down, weights, ids, swiglu_limit)
    if use_triton(x, gate, up, down, weights, ids, force=force_triton):
        return moe_experts_triton(x, gate, up, down, weights, ids, swiglu_limit)
    return moe_experts_ref(x, gate, up, down, weights, ids, swiglu_limit)


def moe_experts_fp8(x: torch.Tensor, gate: torch.Tensor, gate_s: torch.Tensor, up: torch.Tensor,
                    up_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, block: int = 128, swiglu_limit: float | None = None,
                    force_triton: bool = False) -> torch.Tensor:
    """:func:`moe_experts` over FP8 stacks: gate/up [E, I, H] and down [E, H, I] float8_e4m3fn, each
    with its fp32 scale grid [E, ceil(rows/block), ceil(cols/block)]. Returns [N, H] in x.dtype."""
    if as_op():
        return moe_experts_fp8_op(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, swiglu_limit)
    if use_triton(x, gate, up, down, weights, ids, force=force_triton):
        return moe_experts_fp8_triton(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, swiglu_limit)
    return moe_experts_fp8_ref(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, swiglu_limit)


# The dispatchers as custom ops for compiled forwards (kernels/_triton.py's docstring).
@torch.library.custom_op("glm5mtp::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   weights: torch.Tensor, ids: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    if use_triton(x, gate, up, down, weights, ids):
        return moe_experts_triton(x, gate, up, down, weights, ids, swiglu_limit)
    return moe_experts_ref(x, gate, up, down, weights, ids, swiglu_limit)


@moe_experts_op.register_fake
def _(x, gate, up, down, weights, ids, swiglu_limit):
    return x.new_empty(x.shape)


@torch.library.custom_op("glm5mtp::moe_experts_fp8", mutates_args=())
def moe_experts_fp8_op(x: torch.Tensor, gate: torch.Tensor, gate_s: torch.Tensor, up: torch.Tensor,
                       up_s: torch.Tensor, down: torch.Tensor, down_s: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor, block: int, swiglu_limit: float | None) -> torch.Tensor:
    if use_triton(x, gate, up, down, weights, ids):
        return moe_experts_fp8_triton(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, swiglu_limit)
    return moe_experts_fp8_ref(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, swiglu_limit)


@moe_experts_fp8_op.register_fake
def _(x, gate, gate_s, up, up_s, down, down_s, weights, ids, block, swiglu_limit):
    return x.new_empty(x.shape)
