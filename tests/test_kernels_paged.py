"""kernels/paged.py against its references: DSA indexer scores and sparse MLA attention read in place
through the paged pools' slot tables, GLM-5's per-token keys and GLM-5-Next's pooled ones (Triton's
interpreter in a fresh subprocess, as test_kernels.py; compiled on a CUDA machine)."""

import json
from unittest import mock

import torch

# first: test_kernels puts the repository root on sys.path (this file also runs as a script, the
# interpreter worker, where only tests/ is on it)
from test_kernels import BF16, _rand, reference_tests, run_cases
from kernels import paged
from kernels.paged import (Pools, indexer_scores_paged, indexer_scores_paged_ref, mla_attention_paged,
                           mla_attention_paged_ref)


def _seq_indexer(fn, q, k, w, off, scale, **kw):
    """An indexer op over ONE sequence whose keys sit in rows 0..T-1 (identity slots)."""
    slots, starts = torch.arange(k.shape[0], device=k.device)[None], torch.tensor([off], device=k.device)
    return fn(q[None], k, slots, starts, w[None], scale, **kw)[0]


def _seq_mla(fn, qn, qr, kv, idx, off, scale, **kw):
    """An MLA op over ONE sequence whose rows sit in rows 0..T-1 (identity slots)."""
    slots, starts = torch.arange(kv.shape[0], device=kv.device)[None], torch.tensor([off], device=kv.device)
    return fn(qn[None], qr[None], kv, slots, starts, None if idx is None else idx[None], scale, **kw)[0]


def case_indexer_scores(device, big):
    s, hi, d, t = (4, 32, 128, 5000) if big else (3, 5, 24, 50)
    q, k, w = _rand(s, hi, d, device=device), _rand(t, d, device=device), _rand(s, hi, device=device)
    off = t - s - 7  # the last keys are in the future of every query
    return (_seq_indexer(indexer_scores_paged, q, k, w, off, d ** -0.5, force_triton=True),
            _seq_indexer(indexer_scores_paged_ref, q, k, w, off, d ** -0.5))


def case_indexer_scores_bf16_chunks(device, big):
    s, hi, d, t = (20, 32, 128, 3000) if big else (11, 4, 16, 40)  # many queries per key block
    q, k = _rand(s, hi, d, device=device, dtype=BF16), _rand(t, d, device=device, dtype=BF16)
    w = _rand(s, hi, device=device, dtype=BF16)
    off = t - s
    return (_seq_indexer(indexer_scores_paged, q, k, w, off, 0.1, force_triton=True),
            _seq_indexer(indexer_scores_paged_ref, q, k, w, off, 0.1))


def _mla_inputs(device, big, dtype, s=3):
    h, lkv, r, t = (64, 512, 64, 5000) if big else (20, 40, 8, 70)
    qn = _rand(s, h, lkv, device=device, dtype=dtype, scale=0.5)
    qr = _rand(s, h, r, device=device, dtype=dtype, scale=0.5)
    kv = _rand(t, lkv + r, device=device, dtype=dtype)
    return qn, qr, kv, t, (lkv + r) ** -0.5


def case_mla_dense(device, big):
    qn, qr, kv, t, scale = _mla_inputs(device, big, torch.float32)
    off = t - 10
    return (_seq_mla(mla_attention_paged, qn, qr, kv, None, off, scale, force_triton=True),
            _seq_mla(mla_attention_paged_ref, qn, qr, kv, None, off, scale))


def case_mla_dense_no_visible_key(device, big):
    qn, qr, kv, t, scale = _mla_inputs(device, big, torch.float32)
    return (_seq_mla(mla_attention_paged, qn, qr, kv, None, -1, scale, force_triton=True),  # query 0 sees nothing
            _seq_mla(mla_attention_paged_ref, qn, qr, kv, None, -1, scale))


def case_mla_indexed(device, big):
    qn, qr, kv, t, scale = _mla_inputs(device, big, torch.float32, s=4)
    k = 2048 if big else 45
    off = t - 4
    idx = torch.stack([torch.randperm(t, device=device)[:k] for _ in range(4)])
    idx[:, -5:] = -1  # padding
    idx[1, 0] = off + 3  # a future position for query 1 (masked), allowed for query 3
    return (_seq_mla(mla_attention_paged, qn, qr, kv, idx, off, scale, force_triton=True),
            _seq_mla(mla_attention_paged_ref, qn, qr, kv, idx, off, scale))


def case_mla_indexed_bf16(device, big):
    qn, qr, kv, t, scale = _mla_inputs(device, big, BF16, s=2)
    k = 2048 if big else 33
    idx = torch.stack([torch.randperm(t, device=device)[:k] for _ in range(2)]).to(torch.int32)
    return (_seq_mla(mla_attention_paged, qn, qr, kv, idx, t - 2, scale, force_triton=True),
            _seq_mla(mla_attention_paged_ref, qn, qr, kv, idx, t - 2, scale))


def _paged(device, g, nl, width, dtype, pool_rows=None):
    """A pool of rows and each sequence's slot table: shuffled rows (paging), the last row of a
    table padded with sequence 0's first slot, as the engine pads past a sequence's blocks."""
    pool_rows = pool_rows or g * nl + 17
    pool = _rand(pool_rows, width, device=device, dtype=dtype)
    slots = torch.randperm(pool_rows, device=device)[: g * nl].view(g, nl).clone()
    slots[-1, -1] = slots[0, 0]
    return pool, slots


def case_indexer_paged(device, big):
    g, t, hi, d, nl = (3, 4, 32, 128, 4096) if big else (3, 2, 5, 24, 40)
    pool, slots = _paged(device, g, nl, d, torch.float32)
    starts = torch.tensor([nl - t, 5, 0], device=device)  # full, short, empty before this forward
    q, w = _rand(g, t, hi, d, device=device), _rand(g, t, hi, device=device)
    return (indexer_scores_paged(q, pool, slots, starts, w, d ** -0.5, force_triton=True),
            indexer_scores_paged_ref(q, pool, slots, starts, w, d ** -0.5))


def _indexer_pooled(device, big, dtype):
    """GLM-5-Next's pooled keys (P = 4), each split over its pool's 4 rows, read in place: sequences
    with no complete pool yet, some, and every pool complete; a verify's 4 queries complete more."""
    g, t, hi, d, nl, p = (3, 4, 32, 128, 4096, 4) if big else (3, 4, 16, 32, 200, 4)
    pool, slots = _paged(device, g, nl, d // p, dtype)
    starts = torch.tensor([nl - t, 9, 1], device=device)
    q, w = _rand(g, t, hi, d, device=device, dtype=dtype), _rand(g, t, hi, device=device)
    return (indexer_scores_paged(q, pool, slots, starts, w, d ** -0.5, p, force_triton=True),
            indexer_scores_paged_ref(q, pool, slots, starts, w, d ** -0.5, p))


def case_indexer_paged_pooled(device, big):
    return _indexer_pooled(device, big, torch.float32)


def case_indexer_paged_pooled_bf16(device, big):
    return _indexer_pooled(device, big, BF16)


def case_indexer_paged_prefill(device, big):
    """A prefill's queries over several query blocks (the last part-filled; 4 a block in the
    interpreter), pooled (P = 4) and not: key blocks past a query block's last query are skipped
    there and scored for the next block."""
    g, t, hi, d, nl = (3, 300, 32, 128, 2048) if big else (3, 11, 16, 32, 136)
    starts = torch.tensor([0, 70, 3], device=device)
    q, w = _rand(g, t, hi, d, device=device, dtype=BF16), _rand(g, t, hi, device=device)
    out = []
    with mock.patch.object(paged, "SCORES_BLOCK_S", paged.SCORES_BLOCK_S if big else 4):
        for p in (0, 4):
            pool, slots = _paged(device, g, nl, d // max(p, 1), BF16)
            out.append((indexer_scores_paged(q, pool, slots, starts, w, d ** -0.5, p, force_triton=True),
                        indexer_scores_paged_ref(q, pool, slots, starts, w, d ** -0.5, p)))
    return tuple(torch.cat([a.flatten(), b.flatten()]) for a, b in zip(*out))


def case_indexer_paged_wide_table(device, big):
    """Tables far wider than the lengths (the engine's --max-seq-len ceiling): slots past each
    sequence's last query name rows far outside the pool, so a kernel that read them would fault
    or differ; the reference reads the same tables with those slots on a row of NaNs."""
    g, t, hi, d, nl = (2, 2, 32, 128, 8192) if big else (2, 2, 5, 24, 300)
    pool, slots = _paged(device, g, nl, d, torch.float32)
    starts = torch.tensor([5, 70], device=device)  # live keys: 0..6 and 0..71, read in blocks of 64
    pool = torch.cat([pool, torch.full_like(pool[:1], float("nan"))])  # a row no live slot names
    safe = slots.clone()
    for b in range(g):
        safe[b, int(starts[b]) + t:] = pool.shape[0] - 1
        slots[b, -(-(int(starts[b]) + t) // 64) * 64:] = 1 << 40
    q, w = _rand(g, t, hi, d, device=device), _rand(g, t, hi, device=device)
    return (indexer_scores_paged(q, pool, slots, starts, w, d ** -0.5, force_triton=True),
            indexer_scores_paged_ref(q, pool, safe, starts, w, d ** -0.5))


def case_indexer_paged_bf16(device, big):
    g, t, hi, d, nl = (2, 1, 32, 128, 8192) if big else (2, 3, 4, 16, 70)
    pool, slots = _paged(device, g, nl, d, BF16)
    starts = torch.tensor([nl - t, nl // 3], device=device)
    q, w = _rand(g, t, hi, d, device=device, dtype=BF16), _rand(g, t, hi, device=device)
    return (indexer_scores_paged(q, pool, slots, starts, w, 0.1, force_triton=True),
            indexer_scores_paged_ref(q, pool, slots, starts, w, 0.1))


def _mla_paged_inputs(device, big, dtype, g, t):
    h, lkv, r, nl = (64, 512, 64, 4096) if big else (20, 40, 8, 48)
    pool, slots = _paged(device, g, nl, lkv + r, dtype)
    qn = _rand(g, t, h, lkv, device=device, dtype=dtype, scale=0.5)
    qr = _rand(g, t, h, r, device=device, dtype=dtype, scale=0.5)
    return qn, qr, pool, slots, nl, (lkv + r) ** -0.5


def case_mla_paged_dense(device, big):
    qn, qr, pool, slots, nl, scale = _mla_paged_inputs(device, big, torch.float32, 3, 2)
    starts = torch.tensor([nl - 2, 7, 0], device=device)
    return (mla_attention_paged(qn, qr, pool, slots, starts, None, scale, force_triton=True),
            mla_attention_paged_ref(qn, qr, pool, slots, starts, None, scale))


def case_mla_paged_indexed(device, big):
    g, t = 2, 4
    qn, qr, pool, slots, nl, scale = _mla_paged_inputs(device, big, torch.float32, g, t)
    starts = torch.tensor([nl - t, nl // 2], device=device)
    k = 2048 if big else 30
    idx = torch.stack([torch.stack([torch.randperm(nl, device=device)[:k] for _ in range(t)]) for _ in range(g)])
    idx[:, :, -3:] = -1  # padding
    idx[1, 0, 0] = nl // 2 + 3  # a future position for query 0 of sequence 1 (masked)
    return (mla_attention_paged(qn, qr, pool, slots, starts, idx, scale, force_triton=True),
            mla_attention_paged_ref(qn, qr, pool, slots, starts, idx, scale))


def _mla_paged_pools(device, big, dtype, tail, nl_small=48, visible_only=True, strided_q=False):
    """GLM-5-Next's NoPE layer (R = 0): the chosen pools' rows and the tail, a verify's 4 queries;
    sequence 0 chooses no pool for its first query (the tail alone, or nothing: zeros). The
    kernel reads the chosen pools 64 at a time (nl_small 600: three such chunks, several tiles
    each); visible_only False: pools past a query's complete ones chosen too, which the reference
    reads only up to the query. strided_q: q as the absorbed product leaves it, a [G, T, H] view of
    an [H, G * T] batched GEMM's output."""
    g, t, p = 2, 4, 4
    h, lkv, nl = (64, 512, 2048) if big else (6, 40, nl_small)
    pool, slots = _paged(device, g, nl, lkv, dtype)
    if strided_q:
        qn = _rand(h, g * t, lkv, device=device, dtype=dtype, scale=0.5).transpose(0, 1).view(g, t, h, lkv)
    else:
        qn = _rand(g, t, h, lkv, device=device, dtype=dtype, scale=0.5)
    starts = torch.tensor([nl - t, 13], device=device)
    n_pools = nl // p
    visible = (starts[:, None] + torch.arange(t, device=device) + 1) // p  # complete pools each query sees
    chosen = torch.rand(g, t, n_pools, device=device) < 0.4
    if visible_only:
        chosen &= torch.arange(n_pools, device=device) < visible[..., None]
    chosen[0, 0] = False
    pools = Pools(chosen, p, tail)
    args = (qn, qn[..., :0], pool, slots, starts, None, lkv ** -0.5)
    return mla_attention_paged(*args, pools, force_triton=True), mla_attention_paged_ref(*args, pools)


def case_mla_paged_pools(device, big):
    return _mla_paged_pools(device, big, torch.float32, True)


def case_mla_paged_pools_strided_q_bf16(device, big):
    return _mla_paged_pools(device, big, BF16, True, strided_q=True)


def case_mla_paged_pools_no_tail(device, big):
    return _mla_paged_pools(device, big, torch.float32, False)


def case_mla_paged_pools_bf16(device, big):
    return _mla_paged_pools(device, big, BF16, True)


def case_mla_paged_pools_chunks(device, big):
    return _mla_paged_pools(device, big, torch.float32, True, nl_small=600)


def case_mla_paged_pools_any_chosen(device, big):
    return _mla_paged_pools(device, big, torch.float32, True, nl_small=600, visible_only=False)


def case_mla_paged_pools_any_chosen_no_tail(device, big):
    return _mla_paged_pools(device, big, torch.float32, False, nl_small=600, visible_only=False)


def case_mla_paged_indexed_bf16(device, big):
    g, t = 2, 1
    qn, qr, pool, slots, nl, scale = _mla_paged_inputs(device, big, BF16, g, t)
    starts = torch.tensor([nl - 1, 10], device=device)
    k = 2048 if big else 33
    idx = torch.stack([torch.randperm(nl, device=device)[:k] for _ in range(g)])[:, None, :].contiguous()
    return (mla_attention_paged(qn, qr, pool, slots, starts, idx, scale, force_triton=True),
            mla_attention_paged_ref(qn, qr, pool, slots, starts, idx, scale))


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


interpreter_results, test_interpreter_matches_reference, test_cuda_matches_reference = reference_tests(__file__, CASES)


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu", False, CASES)))
