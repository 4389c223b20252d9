"""Block-scaled FP8 weights (GLM-5-FP8's `weight_block_size: [128, 128]`).

A weight ``w`` [M, N] in float8_e4m3fn comes with ``scale_inv`` [ceil(M/b), ceil(N/b)] fp32;
the real weight is ``w * scale_inv`` block by block (edge blocks are partial). Two ops:

- :func:`fp8_block_dequant` materialises the real weight in ``out_dtype``.
- :func:`fp8_block_matmul` computes ``x @ dequant(w)^T`` without materialising it: the Triton
  GEMM loads FP8 tiles, converts them exactly (every e4m3 value is a bf16 value) and applies the
  block scale to each K-step's partial product, accumulating in fp32.

Triton loads float8_e4m3fn directly, in the interpreter as well (checked with triton 3.9: every
code but the two NaN codes 0x7F/0xFF decodes exactly there; the interpreter reads those as 480,
which real weights never contain), so no manual uint8 decoding is needed.
"""

import torch

from ._triton import alloc, as_op, interpreting, jit, tl, triton, use_triton


def _sides(block: int | tuple[int, int]) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def _expand_scale(scale_inv: torch.Tensor, m: int, n: int, block: int | tuple[int, int]) -> torch.Tensor:
    b0, b1 = _sides(block)
    return scale_inv.float().repeat_interleave(b0, -2)[..., :m, :].repeat_interleave(b1, -1)[..., :n]


def _check_scale(w: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int]) -> None:
    m, n = w.shape[-2:]
    b0, b1 = _sides(block)
    want = (*w.shape[:-2], (m + b0 - 1) // b0, (n + b1 - 1) // b1)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not match {want} for a {m}x{n} weight")


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of dequantization, as checkpoints are made: (float8_e4m3fn weight, fp32 scale_inv)
    with one scale per block, scale = block amax / 448 (init-random --fp8, quantize, random FP8 weights).

    `scale_inv` follows the checkpoint convention: it is what the fp8 value is MULTIPLIED by.
    Edge blocks are partial; padding with zeros leaves their amax unchanged.
    """
    rows, cols = w.shape
    b0, b1 = block
    gr, gc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(gr * b0, gc * b1, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(gr, b0, gc, b1)
    # An all-zero block gets a tiny scale rather than 0, so dividing by it stays finite.
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * b0, gc * b1)[:rows, :cols].contiguous(), scale


def fp8_block_dequant_ref(w: torch.Tensor, scale_inv: torch.Tensor, block: int | tuple[int, int] = 128,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """PyTorch reference: w [..., M, N] fp8, scale_inv [..., ceil(M/b0), ceil(N/b1)] -> [..., M, N] out_dtype
    (leading dimensions: a stack of matrices, e.g. the chosen experts, each with its own grid).

    `block` is one side for square blocks or (rows, cols); an edge block may be partial, its scale
    covering whatever part of the block lies inside the matrix. A wrong grid raises ValueError.
    The checkpoint reader dequantizes with this function (fp32 out)."""
    _check_scale(w, scale_inv, block)
    return (w.float() * _expand_scale(scale_inv, *w.shape[-2:], block)).to(out_dtype)


def fp8_block_matmul_ref(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """PyTorch reference: x [..., K] @ dequant(w [N, K])^T in fp32, returned in x.dtype."""
    wf = fp8_block_dequant_ref(w, scale_inv, block, torch.float32)
    return (x.float() @ wf.t()).to(x.dtype)


@jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, M, N, s_cols, BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + pid_m * s_cols + pid_n)
    tl.store(out_ptr + offs, (w * s).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_block_dequant_triton(w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton version of :func:`fp8_block_dequant_ref`; one program per scale block."""
    assert w.dim() == 2 and w.dtype == torch.float8_e4m3fn and w.is_contiguous()
    assert block >= 16 and block & (block - 1) == 0, "block must be a power of two >= 16"
    _check_scale(w, scale_inv, block)
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    m, n = w.shape
    out = alloc((m, n), dtype=out_dtype, device=w.device)
    if m and n:
        grid = (triton.cdiv(m, block), triton.cdiv(n, block))
        _dequant_kernel[grid](w, scale_inv, out, m, n, scale_inv.shape[1], BLOCK=block, num_warps=8)
    return out


@jit
def _matmul_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, stride_xt, s_cols, TILES_PER_SPLIT,
                   BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr):
    # BLOCK_K is the scale block and BLOCK_N divides it, so each K-step of a tile has one scale.
    # Split-K: program (.., .., z) covers K-tiles [z * TILES_PER_SPLIT, ...) and writes slice z of
    # out (fp32 partial sums that the wrapper adds up; with one split, out is the result itself).
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    kb_begin = pid_k * TILES_PER_SPLIT
    kb_end = tl.minimum(kb_begin + TILES_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + (kb_begin * BLOCK_K + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * K + (kb_begin * BLOCK_K + offs_k)[:, None]  # w^T tile
    s_ptrs = s_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * s_cols
    tmask = offs_t < T
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_begin, kb_end):
        kmask = offs_k < K - kb * BLOCK_K
        xa = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
        wb = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        s = tl.load(s_ptrs + kb)
        if DOT_BF16:  # exact products (e4m3 fits in bf16), fp32 accumulation
            part = tl.dot(xa, wb.to(tl.bfloat16))
        else:
            part = tl.dot(xa.to(tl.float32), wb.to(tl.float32), input_precision="ieee")
        acc += part * s
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + pid_k.to(tl.int64) * T * N + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


@jit
def _sum_splits_kernel(part_ptr, out_ptr, SPLIT, NUMEL, BLOCK: tl.constexpr):
    # out = the split-K partial sums part [SPLIT, NUMEL] added in fp32, stored in out's dtype: one
    # launch instead of torch's sum then cast-copy (a decode step runs ~10 split FP8 GEMMs)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for z in range(SPLIT):
        acc += tl.load(part_ptr + z * NUMEL + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_TARGET_PROGRAMS = 264  # two per H200 multiprocessor (132)
# Decode widths (up to 4 rows: a step's verify) on the H200, swept over programs x BLOCK_N x stages
# at the GLM-5 MTP layer's eight FP8 shapes (python -m kernels.sweep_fp8; raw:
# profiles/glm5/fp8_h200/decode_sweep.json): 4 programs per multiprocessor, 32-wide tiles and 4 stages
# took their summed time at one row from 137 to 123 us (o_proj 58 -> 46).
_DECODE_ROWS, _DECODE_PROGRAMS, _DECODE_BLOCK_N, _DECODE_STAGES = 4, 528, 32, 4
_SUM_BLOCK = 1024


def fp8_block_matmul_triton(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                            split_k: int | None = None, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Triton version of :func:`fp8_block_matmul_ref`: a tiled GEMM dequantising `w` on the fly.

    Decode GEMMs (few rows) have too few output tiles to fill the GPU, so K is split until there
    are about `_TARGET_PROGRAMS` programs (`_DECODE_PROGRAMS` at decode widths; `split_k` overrides);
    a second kernel adds the fp32 partial sums in a fixed order (deterministic, unlike atomics) and
    writes x.dtype. `launch` (programs, BLOCK_N, stages) replaces the tuned choice (kernels/sweep_fp8.py).
    """
    assert w.dim() == 2 and w.dtype == torch.float8_e4m3fn and w.is_contiguous()
    assert block >= 16 and block & (block - 1) == 0, "block must be a power of two >= 16"
    _check_scale(w, scale_inv, block)
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    n, k = w.shape
    assert x.shape[-1] == k, f"x width {x.shape[-1]} != weight K {k}"
    x2 = x.reshape(-1, k)
    assert x2.stride(-1) == 1, "x needs a unit stride in its last dimension"
    t = x2.shape[0]
    out = alloc((t, n), dtype=x.dtype, device=x.device)
    if t and n:
        block_t = 16 if t <= 16 else (32 if t <= 32 else 64)
        decode = t <= _DECODE_ROWS
        programs, block_n, stages = launch or ((_DECODE_PROGRAMS, _DECODE_BLOCK_N, _DECODE_STAGES) if decode
                                               else (_TARGET_PROGRAMS, 64, 3))
        block_n = min(block_n, block)
        tiles = triton.cdiv(t, block_t) * triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block)
        split = split_k or max(1, min(k_tiles, programs // tiles))
        per_split = triton.cdiv(k_tiles, split)
        split = triton.cdiv(k_tiles, per_split)  # no empty splits
        dest = out if split == 1 else alloc((split, t, n), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(t, block_t), triton.cdiv(n, block_n), split)
        _matmul_kernel[grid](x2, w, scale_inv, dest, t, n, k, x2.stride(0), scale_inv.shape[1], per_split,
                             BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block,
                             DOT_BF16=x.dtype == torch.bfloat16 and not interpreting(),
                             num_warps=4, num_stages=stages)
        if split > 1:
            _sum_splits_kernel[(triton.cdiv(t * n, _SUM_BLOCK),)](dest, out, split, t * n, BLOCK=_SUM_BLOCK,
                                                                 num_warps=4)
    return out.reshape(*x.shape[:-1], n)


def fp8_block_dequant(w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                      out_dtype: torch.dtype = torch.bfloat16, force_triton: bool = False) -> torch.Tensor:
    """Dequantise a block-scaled FP8 weight.

    Args:
        w: [M, N] float8_e4m3fn.
        scale_inv: [ceil(M/block), ceil(N/block)] fp32, multiplied into each block.
        block: scale block side (128 for GLM-5-FP8).
        out_dtype: dtype of the result.
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        [M, N] tensor in out_dtype.
    """
    if as_op():
        return fp8_block_dequant_op(w, scale_inv, block, out_dtype)
    if use_triton(w, scale_inv, force=force_triton):
        return fp8_block_dequant_triton(w, scale_inv, block, out_dtype)
    return fp8_block_dequant_ref(w, scale_inv, block, out_dtype)


def fp8_block_matmul(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: int = 128,
                     force_triton: bool = False) -> torch.Tensor:
    """``x @ dequant(w)^T`` for a block-scaled FP8 weight (a Linear without bias).

    Args:
        x: [..., K] activations (bf16 or fp32).
        w: [N, K] float8_e4m3fn.
        scale_inv: [ceil(N/block), ceil(K/block)] fp32.
        block: scale block side.
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        [..., N] in x.dtype.
    """
    if as_op():
        return fp8_block_matmul_op(x, w, scale_inv, block)
    if use_triton(x, w, scale_inv, force=force_triton):
        return fp8_block_matmul_triton(x, w, scale_inv, block)
    return fp8_block_matmul_ref(x, w, scale_inv, block)


# ---- per-head products with one block-scaled FP8 matrix (MLA's absorbed kv_b) -------------------------

def fp8_heads_matmul_ref(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, heads: int, row0: int, rows: int,
                         absorb: bool, block: int = 128) -> torch.Tensor:
    """PyTorch reference. w [heads * R, C] is `heads` stacked [R, C] matrices (MLA's kv_b: R = nope + v,
    C = kv_lora); each head uses its rows row0..row0+rows-1, W_h [rows, C]. In fp32, returned in x.dtype:
    absorb: x [..., heads, rows] -> x_h @ W_h [..., heads, C] (q_nope folded into latent space);
    else:   x [..., heads, C] -> x_h @ W_h^T [..., heads, rows] (the output latent through the value half)."""
    wf = fp8_block_dequant_ref(w, scale_inv, block, torch.float32).view(heads, -1, w.shape[1])[:, row0:row0 + rows]
    eq = "...hr,hrc->...hc" if absorb else "...hc,hrc->...hr"
    return torch.einsum(eq, x.float(), wf).to(x.dtype)


@jit
def _heads_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, C, R, row0, stride_xt, stride_xh, s_cols, SB,
                  ABSORB: tl.constexpr, BLOCK_T: tl.constexpr, TILE: tl.constexpr, DOT_BF16: tl.constexpr):
    # program (t-tile, head * n-tiles): out[t, h, n-tile] = sum over K in TILE steps of x[t, h, k] * Wt[k, n],
    # Wt[k, n] = W[h*R + row0 + n, k] (value) or W[h*R + row0 + k, n] (absorb). TILE divides R, row0 and
    # the scale block SB, so every [TILE x TILE] weight tile has one scale.
    pid_t = tl.program_id(0)
    n_tiles = tl.cdiv(N, TILE)
    h = tl.program_id(1) // n_tiles
    n0 = (tl.program_id(1) % n_tiles) * TILE
    base = h * R + row0
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.arange(0, TILE)
    tmask = offs_t < T
    nmask = n0 + offs < N
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + h * stride_xh
    acc = tl.zeros((BLOCK_T, TILE), dtype=tl.float32)
    for k0 in range(0, K, TILE):
        kmask = k0 + offs < K
        xa = tl.load(x_rows + (k0 + offs)[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        m = kmask[:, None] & nmask[None, :]
        if ABSORB:
            wt = tl.load(w_ptr + (base + k0 + offs)[:, None].to(tl.int64) * C + (n0 + offs)[None, :], mask=m, other=0.0)
            s = tl.load(s_ptr + ((base + k0) // SB) * s_cols + n0 // SB)
        else:
            wt = tl.load(w_ptr + (base + n0 + offs)[None, :].to(tl.int64) * C + (k0 + offs)[:, None], mask=m, other=0.0)
            s = tl.load(s_ptr + ((base + n0) // SB) * s_cols + k0 // SB)
        if DOT_BF16:
            part = tl.dot(xa, wt.to(tl.bfloat16))
        else:
            part = tl.dot(xa.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        acc += part * s
    out = out_ptr + offs_t[:, None].to(tl.int64) * (tl.num_programs(1) // n_tiles) * N + h * N + n0 + offs[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


def heads_tile(r: int, row0: int, block: int) -> int:
    """The kernel's square weight tile: the largest power of two <= 64 dividing R, row0 and the block
    (0 when below 16, the smallest tl.dot side: the caller then dequantizes instead)."""
    tile = 64
    while tile >= 16 and (r % tile or row0 % tile or block % tile):
        tile //= 2
    return tile if tile >= 16 else 0


def fp8_heads_matmul_triton(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, heads: int, row0: int,
                            rows: int, absorb: bool, block: int = 128) -> torch.Tensor:
    """Triton version of :func:`fp8_heads_matmul_ref`: the FP8 matrix read in place, once per row tile
    (no dequantized copy: MLA's kv_b is 29 MB in bf16 at GLM-5's dims, 14.7 MB in FP8)."""
    assert w.dim() == 2 and w.dtype == torch.float8_e4m3fn and w.is_contiguous()
    _check_scale(w, scale_inv, block)
    assert scale_inv.dtype == torch.float32 and scale_inv.is_contiguous()
    r, c = w.shape[0] // heads, w.shape[1]
    assert r * heads == w.shape[0] and 0 <= row0 and row0 + rows <= r, f"{heads} heads of rows {row0}.. in {tuple(w.shape)}"
    tile = heads_tile(r, row0, block)
    assert tile, f"no tile of 16..64 divides R {r}, row0 {row0} and block {block}"
    k, n = (rows, c) if absorb else (c, rows)
    assert x.shape[-2:] == (heads, k), f"x {tuple(x.shape)} should end in ({heads}, {k})"
    x3 = x.reshape(-1, heads, k)
    assert x3.stride(-1) == 1, "x needs a unit stride in its last dimension"
    t = x3.shape[0]
    out = alloc((t, heads, n), dtype=x.dtype, device=x.device)
    if t and n and heads:
        block_t = 16 if t <= 16 else (32 if t <= 32 else 64)
        grid = (triton.cdiv(t, block_t), heads * triton.cdiv(n, tile))
        _heads_kernel[grid](x3, w, scale_inv, out, t, n, k, c, r, row0, x3.stride(0), x3.stride(1),
                            scale_inv.shape[1], block, ABSORB=absorb, BLOCK_T=block_t, TILE=tile,
                            DOT_BF16=x.dtype == torch.bfloat16 and not interpreting(), num_warps=4)
    return out.reshape(*x.shape[:-1], n)


def fp8_heads_matmul(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, heads: int, row0: int, rows: int,
                     absorb: bool, block: int = 128, force_triton: bool = False) -> torch.Tensor:
    """Per-head products with slices of one block-scaled FP8 matrix (see :func:`fp8_heads_matmul_ref`);
    the Triton kernel when the heads' rows align to a 16..64 tile, else the reference."""
    if as_op():
        return fp8_heads_matmul_op(x, w, scale_inv, heads, row0, rows, absorb, block)
    if heads_tile(w.shape[0] // heads, row0, block) and use_triton(x, w, scale_inv, force=force_triton):
        return fp8_heads_matmul_triton(x, w, scale_inv, heads, row0, rows, absorb, block)
    return fp8_heads_matmul_ref(x, w, scale_inv, heads, row0, rows, absorb, block)


# ---- the dispatchers as custom ops for compiled forwards (kernels/_triton.py's docstring) -------------

@torch.library.custom_op("glm5mtp::fp8_block_dequant", mutates_args=())
def fp8_block_dequant_op(w: torch.Tensor, scale_inv: torch.Tensor, block: int, out_dtype: torch.dtype) -> torch.Tensor:
    if use_triton(w, scale_inv):
        return fp8_block_dequant_triton(w, scale_inv, block, out_dtype)
    return fp8_block_dequant_ref(w, scale_inv, block, out_dtype)


@fp8_block_dequant_op.register_fake
def _(w, scale_inv, block, out_dtype):
    return w.new_empty(w.shape, dtype=out_dtype)


@torch.library.custom_op("glm5mtp::fp8_block_matmul", mutates_args=())
def fp8_block_matmul_op(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: int) -> torch.Tensor:
    if use_triton(x, w, scale_inv):
        return fp8_block_matmul_triton(x, w, scale_inv, block)
    return fp8_block_matmul_ref(x, w, scale_inv, block)


@fp8_block_matmul_op.register_fake
def _(x, w, scale_inv, block):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("glm5mtp::fp8_heads_matmul", mutates_args=())
def fp8_heads_matmul_op(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, heads: int, row0: int, rows: int,
                        absorb: bool, block: int) -> torch.Tensor:
    if heads_tile(w.shape[0] // heads, row0, block) and use_triton(x, w, scale_inv):
        return fp8_heads_matmul_triton(x, w, scale_inv, heads, row0, rows, absorb, block)
    # einsum may lay its result out permuted; the op's outputs are contiguous like the kernel's
    return fp8_heads_matmul_ref(x, w, scale_inv, heads, row0, rows, absorb, block).contiguous()


@fp8_heads_matmul_op.register_fake
def _(x, w, scale_inv, heads, row0, rows, absorb, block):
    return x.new_empty((*x.shape[:-1], w.shape[1] if absorb else rows))
