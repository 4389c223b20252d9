"""DSA indexer scores and absorbed-MLA attention over the PAGED caches, for a batch of sequences.

The engine keeps every sequence's cache rows in block pools: row l of sequence g lives at pool row
``slots[g, l]`` (slots [G, NL], past a sequence's length they point anywhere). Each of the G
sequences appends T query rows at its own cached length ``starts[g]`` (a device tensor, so a CUDA
graph replays with new lengths); query s of sequence g sits at position ``starts[g] + s`` and sees
keys l <= starts[g] + s.

- :func:`indexer_scores_paged`: ``scale * sum_h w[g, s, h] * relu(q[g, s, h] . k[l])`` [G, T, NL]
  in fp32, -inf past the causal limit. With ``pool_size`` P (GLM-5-Next's pooled indexer) the keys
  are pooled ones, key p split over rows pP..pP+P-1 of the pool (D/P columns each): [G, T, NL // P],
  -inf from each query's first incomplete pool on.
- :func:`mla_attention_paged`: softmax attention of the absorbed queries over the latent rows,
  restricted to the indexer's picks ``index`` [G, T, K] (positions, -1 or masked ones ignored),
  or over every visible row without an index (softmax in fp32; a query that sees no row gets
  zeros). Output [G, T, H, Lkv], still latent. GLM-5-Next's NoPE layers (R = 0) pass their pooled
  indexer's choice instead, ``pools`` (:class:`Pools`): the rows of the chosen pools of P, plus the
  query's incomplete tail pool. The kernel reads those rows only: the chosen flags 64 pools at a
  time, each chunk's chosen pools compacted into tiles of 32 rows. It walked every visible row
  under the choice as a mask before, which at 4096 cached rows made it 58% of glm5next-nano's draft
  step on an H100 (0.169 of 0.291 ms; glm5-nano's indexed attention over its 128 picks: 0.007 ms).

Both read the pool rows in place: no gathered copy of the cache, no [G, T, H, NL] score tensor.
"""

from typing import NamedTuple

import torch

from ._triton import alloc, as_op, interpreting, jit, next_pow2, tl, triton, use_triton


# One program per (query, 16 heads) streams the query's keys. On the H200 that won with 128 keys per
# query (glm5-nano decode 0.96 -> 0.68 ms) and lost with GLM-5's 2048 (4 programs at batch 1: draft
# step 1.24 -> 1.37 ms), so the models use it for selections up to this many keys.
MAX_SELECTED = 512


class Pools(NamedTuple):
    """A pooled indexer's choice: chosen [G, T, Np] bool (pool p holds rows pP..pP+P-1), the pool
    size P, and whether each query also sees its incomplete tail pool, rows P floor((s+1)/P)..s."""

    chosen: torch.Tensor
    size: int
    tail: bool


def _indexer_scores_one(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal_offset: int,
                         scale: float, pool_size: int = 0) -> torch.Tensor:
    """One sequence's scores: q [S, Hi, D], k [T, D] (its keys 0..T-1), w [S, Hi] -> fp32 [S, T];
    query s sits at position causal_offset + s. pool_size P: key p is pool p, which query s sees
    once complete (p < (causal_offset + s + 1) // P)."""
    logits = torch.einsum("shd,td->sht", q.float(), k.float()).relu()
    scores = (logits * w.float()[:, :, None]).sum(1) * scale
    s, t = scores.shape
    pos = torch.arange(t, device=q.device)[None, :]
    limit = causal_offset + torch.arange(s, device=q.device)[:, None]
    if pool_size:
        limit = (limit + 1) // pool_size - 1
    return scores.masked_fill(pos > limit, float("-inf"))


def _mla_attention_one(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                       index: torch.Tensor | None, causal_offset: int, scale: float,
                       pools: Pools | None = None) -> torch.Tensor:
    """One sequence's attention over its rows kv_cache [T, Lkv + R] (fp32 math): [S, H, Lkv] in
    q_nope_absorbed.dtype; a query that sees no key gets zeros. pools: this sequence's [S, Np]."""
    s_len, _, lkv = q_nope_absorbed.shape
    r = q_rope.shape[-1]
    t_len = kv_cache.shape[0]
    kv = kv_cache.float()
    c, kr = kv[:, :lkv], kv[:, lkv:lkv + r]
    qn, qr = q_nope_absorbed.float(), q_rope.float()
    limit = causal_offset + torch.arange(s_len, device=kv.device)[:, None]  # [S, 1]
    if index is None:
        pos = torch.arange(t_len, device=kv.device)[None, :]  # [1, T]
        scores = torch.einsum("shl,tl->sht", qn, c) + torch.einsum("shr,tr->sht", qr, kr)
    else:
        pos = index.long()  # [S, K]
        safe = pos.clamp(0, max(t_len - 1, 0))
        c, kr = c[safe], kr[safe]  # [S, K, Lkv], [S, K, R]
        scores = torch.einsum("shl,skl->shk", qn, c) + torch.einsum("shr,skr->shk", qr, kr)
    valid = (pos >= 0) & (pos <= limit) & (pos < t_len)  # [S, T] or [S, K]
    if pools is not None:
        n_pools = pools.chosen.shape[-1]
        chosen = pools.chosen[:, (pos[0] // pools.size).clamp(max=max(n_pools - 1, 0))] if n_pools else valid & False
        keep = chosen & (pos < n_pools * pools.size)
        if pools.tail:
            keep = keep | (pos >= (limit + 1) // pools.size * pools.size)
        valid = valid & keep
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(valid.any(-1)[:, None, None], p, torch.zeros_like(p))  # no visible key -> zeros
    out = torch.einsum("sht,tl->shl", p, c) if index is None else torch.einsum("shk,skl->shl", p, c)
    return out.to(q_nope_absorbed.dtype)


def indexer_scores_paged_ref(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                             w: torch.Tensor, scale: float, pool_size: int = 0) -> torch.Tensor:
    """PyTorch reference: q [G, T, Hi, D], pool [N, D] ([N, D / P] pooled), slots [G, NL], starts [G],
    w [G, T, Hi]."""
    n_keys = slots.shape[1] // pool_size * pool_size if pool_size else slots.shape[1]
    return torch.stack([_indexer_scores_one(q[g], pool[slots[g, :n_keys]].reshape(-1, q.shape[-1]), w[g],
                                            int(starts[g]), scale, pool_size)
                        for g in range(q.shape[0])])


def mla_attention_paged_ref(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor,
                            slots: torch.Tensor, starts: torch.Tensor, index: torch.Tensor | None,
                            scale: float, pools: Pools | None = None) -> torch.Tensor:
    """PyTorch reference: q_nope_absorbed [G, T, H, Lkv], q_rope [G, T, H, R], pool [N, Lkv + R]."""
    return torch.stack([_mla_attention_one(q_nope_absorbed[g], q_rope[g], pool[slots[g]],
                                           None if index is None else index[g], int(starts[g]), scale,
                                           None if pools is None else pools._replace(chosen=pools.chosen[g]))
                        for g in range(q_nope_absorbed.shape[0])])


@jit
def _paged_scores_kernel(q_ptr, k_ptr, w_ptr, slots_ptr, starts_ptr, out_ptr, T, HI, D, NL, scale,
                         stride_qg, stride_qs, stride_qh, stride_kt, stride_wg, stride_ws, stride_sg,
                         BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr, DOT_BF16: tl.constexpr, POOL: tl.constexpr):
    # Grid (key blocks, sequences, query blocks): a program reads its block of keys once (through
    # the slot table), then loops over its BLOCK_S queries and over head blocks. A block wholly past
    # the block's last query (the engine's tables span its longest sequence) reads nothing.
    # POOL > 0: key l is pool l, its column d in row l * POOL + d // (D / POOL) of the pool.
    pid_l = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    s_lo = tl.program_id(2) * BLOCK_S
    s_hi = tl.minimum(s_lo + BLOCK_S, T)
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_H)
    start = tl.load(starts_ptr + g)
    if POOL > 0:  # keys some query of this block sees
        seen = (start + s_hi) // POOL
    else:
        seen = start + s_hi
    lmask = (offs_l < NL) & (offs_l < seen)
    dmask = offs_d < D
    kmask = dmask[:, None] & lmask[None, :]
    if POOL > 0:
        rows = offs_l[None, :] * POOL + (offs_d // (D // POOL))[:, None]
        slot = tl.load(slots_ptr + g * stride_sg + rows, mask=kmask, other=0).to(tl.int64)
        kt = tl.load(k_ptr + (offs_d % (D // POOL))[:, None] + slot * stride_kt, mask=kmask, other=0.0)
    else:
        slot = tl.load(slots_ptr + g * stride_sg + offs_l, mask=lmask, other=0).to(tl.int64)
        kt = tl.load(k_ptr + offs_d[:, None] + slot[None, :] * stride_kt, mask=kmask, other=0.0)  # k^T
    if not DOT_BF16:
        kt = kt.to(tl.float32)
    n_q = tl.where(pid_l * BLOCK_L < seen, s_hi, s_lo)  # no query of this block sees the keys: none
    for s in range(s_lo, n_q):
        q_row = q_ptr + g * stride_qg + s * stride_qs
        w_row = w_ptr + g * stride_wg + s * stride_ws
        acc = tl.zeros((BLOCK_L,), dtype=tl.float32)
        for h0 in range(0, HI, BLOCK_H):
            hmask = (h0 + offs_h) < HI
            qb = tl.load(q_row + (h0 + offs_h)[:, None] * stride_qh + offs_d[None, :],
                         mask=hmask[:, None] & dmask[None, :], other=0.0)
            if DOT_BF16:
                logits = tl.dot(qb, kt)
            else:
                logits = tl.dot(qb.to(tl.float32), kt, input_precision="ieee")
            wv = tl.load(w_row + h0 + offs_h, mask=hmask, other=0.0).to(tl.float32)
            acc += tl.sum(tl.maximum(logits, 0.0) * wv[:, None], axis=0)
        if POOL > 0:
            limit = (start + s + 1) // POOL - 1
        else:
            limit = start + s
        res = tl.where(offs_l <= limit, acc * scale, float("-inf"))
        tl.store(out_ptr + (g * T + s) * NL + offs_l, res, mask=offs_l < NL)
    for s in range(n_q, s_hi):
        tl.store(out_ptr + (g * T + s) * NL + offs_l, tl.full((BLOCK_L,), float("-inf"), tl.float32),
                 mask=offs_l < NL)


# queries a scores program takes: a decode's or verify's fit one block, as before; a prefill's
# hundreds were one program's loop per key block (~220 us a call in glm5-nano's and glm5next-nano's
# HumanEval admissions on the H200), now spread over programs
SCORES_BLOCK_S = 16


def indexer_scores_paged_triton(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                                w: torch.Tensor, scale: float, pool_size: int = 0) -> torch.Tensor:
    """Triton version of :func:`indexer_scores_paged_ref`; grid (key blocks of 64, sequences, query
    blocks of SCORES_BLOCK_S)."""
    assert q.dim() == 4 and pool.dim() == 2 and slots.dim() == 2 and w.dim() == 3
    g, t, hi, d = q.shape
    nl = slots.shape[1] // pool_size if pool_size else slots.shape[1]
    assert pool.shape[1] * max(pool_size, 1) == d, f"pool width {pool.shape[1]} does not hold D = {d}"
    assert w.shape == (g, t, hi) and slots.shape[0] == g and starts.shape == (g,)
    assert q.stride(-1) == 1 and pool.stride(-1) == 1 and w.stride(-1) == 1 and slots.stride(-1) == 1
    out = alloc((g, t, nl), dtype=torch.float32, device=q.device)
    if g and t and nl:
        block_l = 64
        dot_bf16 = q.dtype == pool.dtype == torch.bfloat16 and not interpreting()
        _paged_scores_kernel[(triton.cdiv(nl, block_l), g, triton.cdiv(t, SCORES_BLOCK_S))](
            q, pool, w, slots, starts, out, t, hi, d, nl, scale,
            q.stride(0), q.stride(1), q.stride(2), pool.stride(0), w.stride(0), w.stride(1), slots.stride(0),
            BLOCK_L=block_l, BLOCK_H=min(32, next_pow2(hi)), BLOCK_D=next_pow2(d), BLOCK_S=SCORES_BLOCK_S,
            DOT_BF16=dot_bf16, POOL=pool_size, num_warps=4)
    return out


@jit
def _attend_rows(qn, qr, kv_ptr, slots_ptr, g, stride_sg, stride_kv, pos, valid, offs_l, offs_r, lmask, rmask, L,
                 scale, m, l_sum, acc, DOT_BF16: tl.constexpr):
    """One tile of a query's keys, the sequence's rows `pos` where `valid`, into the online softmax
    (m, l_sum, acc) -> its new state."""
    slot = tl.load(slots_ptr + g * stride_sg + tl.where(valid, pos, 0), mask=valid, other=0)
    rows = kv_ptr + slot.to(tl.int64) * stride_kv
    c = tl.load(rows[:, None] + offs_l[None, :], mask=valid[:, None] & lmask[None, :], other=0.0)
    kr = tl.load(rows[:, None] + L + offs_r[None, :], mask=valid[:, None] & rmask[None, :], other=0.0)
    if DOT_BF16:
        sc = tl.dot(qn, tl.trans(c)) + tl.dot(qr, tl.trans(kr))
    else:
        c = c.to(tl.float32)
        sc = (tl.dot(qn, tl.trans(c), input_precision="ieee")
              + tl.dot(qr, tl.trans(kr.to(tl.float32)), input_precision="ieee"))
    sc = tl.where(valid[None, :], sc * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # keeps exp() finite before any key
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    if DOT_BF16:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), c)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
    return m_new, l_sum, acc


@jit
def _paged_mla_kernel(qn_ptr, qr_ptr, kv_ptr, slots_ptr, starts_ptr, idx_ptr, chosen_ptr, out_ptr,
                      T, H, L, R, NL, NKEYS, NP, scale,
                      stride_qng, stride_qns, stride_qnh, stride_qrg, stride_qrs, stride_qrh, stride_kv,
                      stride_sg, stride_ig, stride_is, stride_cg, stride_cs,
                      HAS_INDEX: tl.constexpr, POOL: tl.constexpr, TAIL: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr,
                      DOT_BF16: tl.constexpr):
    q_id = tl.program_id(0)
    g = (q_id // T).to(tl.int64)
    s = q_id % T
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    hmask, lmask, rmask = offs_h < H, offs_l < L, offs_r < R
    qn = tl.load(qn_ptr + g * stride_qng + s * stride_qns + offs_h[:, None] * stride_qnh + offs_l[None, :],
                 mask=hmask[:, None] & lmask[None, :], other=0.0)
    qr = tl.load(qr_ptr + g * stride_qrg + s * stride_qrs + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0)
    if not DOT_BF16:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)
    limit = tl.load(starts_ptr + g) + s
    m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    if POOL > 0:
        # The chosen pools' rows, in chunks of CHUNK pools: each chunk's chosen ones compacted
        # (pool k of a tile is the one where the chunk's running count passes k), so only chosen
        # rows are read; then the tail pool's rows, P floor((s+1)/P)..s. Pools from the tail's on
        # hold no row the two parts do not already cover.
        tail_start = (limit + 1) // POOL * POOL
        if TAIL:
            n_pools = tl.minimum(NP, (limit + 1) // POOL)
        else:
            n_pools = tl.minimum(NP, limit // POOL + 1)
        offs_c = tl.arange(0, CHUNK)
        k_of = tl.arange(0, BLOCK_T) // POOL  # each tile row's pool among the tile's
        r_of = tl.arange(0, BLOCK_T) % POOL  # and its row in that pool
        for c0 in range(0, n_pools, CHUNK):
            flag = (tl.load(chosen_ptr + g * stride_cg + s * stride_cs + c0 + offs_c,
                            mask=c0 + offs_c < n_pools, other=0) != 0).to(tl.int32)
            count = tl.cumsum(flag, axis=0)
            n_chosen = tl.sum(flag, axis=0)
            for k0 in range(0, n_chosen, BLOCK_T // POOL):
                k = k0 + k_of
                p = tl.sum((count[None, :] <= k[:, None]).to(tl.int32), axis=1)
                pos = (c0 + p) * POOL + r_of
                valid = (k < n_chosen) & (pos <= limit) & (pos < NL)
                m, l_sum, acc = _attend_rows(qn, qr, kv_ptr, slots_ptr, g, stride_sg, stride_kv, pos, valid, offs_l,
                                             offs_r, lmask, rmask, L, scale, m, l_sum, acc, DOT_BF16)
        if TAIL:
            pos = tail_start + tl.arange(0, BLOCK_T)
            valid = (pos <= limit) & (pos < NL)
            m, l_sum, acc = _attend_rows(qn, qr, kv_ptr, slots_ptr, g, stride_sg, stride_kv, pos, valid, offs_l,
                                         offs_r, lmask, rmask, L, scale, m, l_sum, acc, DOT_BF16)
    else:
        if HAS_INDEX:
            n_keys = NKEYS
        else:
            n_keys = tl.minimum(NL, limit + 1)
        for j0 in range(0, n_keys, BLOCK_T):
            offs_j = j0 + tl.arange(0, BLOCK_T)
            if HAS_INDEX:
                pos = tl.load(idx_ptr + g * stride_ig + s * stride_is + offs_j, mask=offs_j < NKEYS, other=-1)
            else:
                pos = offs_j
            valid = (pos >= 0) & (pos <= limit) & (pos < NL)
            m, l_sum, acc = _attend_rows(qn, qr, kv_ptr, slots_ptr, g, stride_sg, stride_kv, pos, valid, offs_l,
                                         offs_r, lmask, rmask, L, scale, m, l_sum, acc, DOT_BF16)
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    dst = out_ptr + (q_id.to(tl.int64) * H + offs_h[:, None]) * L + offs_l[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & lmask[None, :])


def mla_attention_paged_triton(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor,
                               slots: torch.Tensor, starts: torch.Tensor, index: torch.Tensor | None,
                               scale: float, pools: Pools | None = None) -> torch.Tensor:
    """Triton version of :func:`mla_attention_paged_ref`; grid (G * T queries, head blocks of 16)."""
    assert q_nope_absorbed.dim() == 4 and q_rope.dim() == 4 and pool.dim() == 2 and slots.dim() == 2
    g, t, h, lkv = q_nope_absorbed.shape
    r = q_rope.shape[-1]
    nl = slots.shape[1]
    assert q_rope.shape[:3] == (g, t, h), "q_rope must be [G, T, H, R]"
    assert pool.shape[1] == lkv + r, f"pool width {pool.shape[1]} != Lkv + R = {lkv + r}"
    assert slots.shape[0] == g and starts.shape == (g,)
    for name, ten in (("q_nope_absorbed", q_nope_absorbed), ("q_rope", q_rope), ("pool", pool), ("slots", slots)):
        assert ten.stride(-1) == 1, f"{name} needs a unit stride in its last dimension"
    if index is not None:
        assert index.dim() == 3 and index.shape[:2] == (g, t) and index.stride(-1) == 1, "index must be [G, T, K]"
        assert not index.dtype.is_floating_point, "index must be integer"
    if pools is not None:
        assert pools.chosen.shape[:2] == (g, t) and pools.chosen.stride(-1) == 1, "pools.chosen must be [G, T, Np]"
        assert 0 < pools.size <= 32, "a pool's tail must fit one tile of 32 keys"
    out = alloc((g, t, h, lkv), dtype=q_nope_absorbed.dtype, device=q_nope_absorbed.device)
    if g and t and h:
        block_h = 16
        dot_bf16 = (q_nope_absorbed.dtype == q_rope.dtype == pool.dtype == torch.bfloat16 and not interpreting())
        idx = index if index is not None else slots  # dummy pointer when there is no index
        chosen = pools.chosen.view(torch.uint8) if pools is not None else slots  # likewise
        _paged_mla_kernel[(g * t, triton.cdiv(h, block_h))](
            q_nope_absorbed, q_rope, pool, slots, starts, idx, chosen, out, t, h, lkv, r, nl,
            index.shape[2] if index is not None else 0, chosen.shape[-1] if pools is not None else 0, scale,
            q_nope_absorbed.stride(0), q_nope_absorbed.stride(1), q_nope_absorbed.stride(2),
            q_rope.stride(0), q_rope.stride(1), q_rope.stride(2), pool.stride(0), slots.stride(0),
            index.stride(0) if index is not None else 0, index.stride(1) if index is not None else 0,
            chosen.stride(0) if pools is not None else 0, chosen.stride(1) if pools is not None else 0,
            HAS_INDEX=index is not None, POOL=pools.size if pools is not None else 0,
            TAIL=pools is not None and pools.tail, BLOCK_H=block_h, BLOCK_L=next_pow2(lkv),
            BLOCK_R=next_pow2(r), BLOCK_T=32, CHUNK=64, DOT_BF16=dot_bf16, num_warps=4, num_stages=2)
    return out


def indexer_scores_paged(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                         w: torch.Tensor, scale: float, pool_size: int = 0, force_triton: bool = False) -> torch.Tensor:
    """Indexer scores of G sequences' T queries over their paged keys (see the module docstring).

    Args:
        q: [G, T, Hi, D] indexer queries (rope applied).
        pool: [N, D] the indexer-key pool of this layer.
        slots: [G, NL] pool row of each sequence's key 0..NL-1.
        starts: [G] each sequence's cached length before this forward (query s at starts + s).
        w: [G, T, Hi] per-head weights (fp32).
        scale: multiplies every score.
        pool_size: P > 0 for pooled keys (the module docstring); pool then [N, D / P].
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        fp32 [G, T, NL] ([G, T, NL // P] pooled), -inf past each query's causal limit.
    """
    if as_op():
        return indexer_scores_paged_op(q, pool, slots, starts, w, scale, pool_size)
    if use_triton(q, pool, w, force=force_triton):
        return indexer_scores_paged_triton(q, pool, slots, starts, w, scale, pool_size)
    return indexer_scores_paged_ref(q, pool, slots, starts, w, scale, pool_size)


def mla_attention_paged(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor,
                        slots: torch.Tensor, starts: torch.Tensor, index: torch.Tensor | None, scale: float,
                        pools: Pools | None = None, force_triton: bool = False) -> torch.Tensor:
    """Absorbed-MLA attention of G sequences' T queries over their paged latent rows.

    Args:
        q_nope_absorbed: [G, T, H, Lkv] no-rope queries multiplied by W_UK.
        q_rope: [G, T, H, R] rope part of the queries (rope applied).
        pool: [N, Lkv + R] the MLA pool of this layer (rows [latent | rope key]).
        slots: [G, NL] pool row of each sequence's row 0..NL-1.
        starts: [G] each sequence's cached length before this forward.
        index: [G, T, K] positions each query may attend to (the indexer's top-k), or None for all.
        scale: softmax scale.
        pools: GLM-5-Next's pooled choice (:class:`Pools`; no index): only its rows are attended.
        force_triton: run the Triton kernel in the interpreter (tests only).
    Returns:
        [G, T, H, Lkv] latent outputs in q_nope_absorbed.dtype.
    """
    if as_op():
        chosen, size, tail = pools if pools is not None else (None, 0, False)
        return mla_attention_paged_op(q_nope_absorbed, q_rope, pool, slots, starts, index, scale, chosen, size, tail)
    tensors = (q_nope_absorbed, q_rope, pool) + ((index,) if index is not None else ())
    if use_triton(*tensors, force=force_triton):
        return mla_attention_paged_triton(q_nope_absorbed, q_rope, pool, slots, starts, index, scale, pools)
    return mla_attention_paged_ref(q_nope_absorbed, q_rope, pool, slots, starts, index, scale, pools)


# The dispatchers as custom ops for compiled forwards (kernels/_triton.py's docstring); they only
# read the pools (the models write the new rows before).
@torch.library.custom_op("glm5mtp::indexer_scores_paged", mutates_args=())
def indexer_scores_paged_op(q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                            w: torch.Tensor, scale: float, pool_size: int) -> torch.Tensor:
    if use_triton(q, pool, w):
        return indexer_scores_paged_triton(q, pool, slots, starts, w, scale, pool_size)
    return indexer_scores_paged_ref(q, pool, slots, starts, w, scale, pool_size)


@indexer_scores_paged_op.register_fake
def _(q, pool, slots, starts, w, scale, pool_size):
    keys = slots.shape[1] // pool_size if pool_size else slots.shape[1]
    return q.new_empty((q.shape[0], q.shape[1], keys), dtype=torch.float32)


@torch.library.custom_op("glm5mtp::mla_attention_paged", mutates_args=())
def mla_attention_paged_op(q_nope_absorbed: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor,
                           slots: torch.Tensor, starts: torch.Tensor, index: torch.Tensor | None,
                           scale: float, chosen: torch.Tensor | None, pool_size: int, tail: bool) -> torch.Tensor:
    pools = Pools(chosen, pool_size, tail) if chosen is not None else None
    tensors = (q_nope_absorbed, q_rope, pool) + ((index,) if index is not None else ())
    if use_triton(*tensors):
        return mla_attention_paged_triton(q_nope_absorbed, q_rope, pool, slots, starts, index, scale, pools)
    return mla_attention_paged_ref(q_nope_absorbed, q_rope, pool, slots, starts, index, scale, pools)


@mla_attention_paged_op.register_fake
def _(q_nope_absorbed, q_rope, pool, slots, starts, index, scale, chosen, pool_size, tail):
    return torch.empty_like(q_nope_absorbed, memory_format=torch.contiguous_format)
