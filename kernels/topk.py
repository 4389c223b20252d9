"""The indices of each row's k largest values, as a set (DSA's indexer selection, MoE routing).

torch.topk on CUDA runs one radix select per row in a single block plus a gather (`sbtopk`): 14 us
for one 4096-wide row on the H200, the draft step's costliest small kernel at GLM-5's dims
(index_topk 2048). The Triton kernel here finds the k-th largest value of a row by deciding its 32
bits from the top, each bit by counting the values at or above a candidate, then writes the
indices of the values above it and of as many equal to it as k needs, in index order (ties at the
boundary go to the lowest indices). Callers use the result as a set, so index order costs nothing.

Floats are compared through their bits mapped to unsigned integers in the same order (flip every
bit of a negative, the sign bit of a positive); -inf (masked keys) orders below every finite value.
NaN has no place in a ranking and is not expected.
"""

import torch

from ._triton import as_op, jit, next_pow2, tl, use_triton

_MAX_BLOCK = 4096  # values per chunk of a row (16 per thread at 8 warps); longer rows loop


def topk_indices_ref(x: torch.Tensor, k: int) -> torch.Tensor:
    """PyTorch reference: the indices [..., k] (int64) of the k largest of x [..., L] along the last
    dimension, in no particular order (which of several equal values at the boundary: unspecified)."""
    return x.topk(k, dim=-1, sorted=False).indices


@jit
def _ordered(x_ptr, offs, L):
    # float -> uint32 with the floats' order; padding reads as 0, below every real value's code
    bits = tl.load(x_ptr + offs, mask=offs < L, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    flip = tl.where(bits < 0, -1, -2147483648)  # all bits of a negative, the sign bit of a positive
    code = (bits ^ flip).to(tl.uint32, bitcast=True)
    return tl.where(offs < L, code, tl.zeros_like(code))


@jit
def _topk_kernel(x_ptr, out_ptr, L, K, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_o
    offs0 = tl.arange(0, BLOCK)
    # the k-th largest code: the largest `thr` with at least K codes >= thr, decided bit by bit
    thr = tl.zeros((), dtype=tl.uint32)
    bit = tl.full((), 2147483648, tl.uint32)
    for _ in range(32):
        cand = thr | bit
        count = tl.zeros((), dtype=tl.int32)
        for c in range(0, L, BLOCK):
            count += tl.sum((_ordered(x_row, c + offs0, L) >= cand).to(tl.int32))
        thr = tl.where(count >= K, cand, thr)
        bit = bit >> 1
    above = tl.zeros((), dtype=tl.int32)
    for c in range(0, L, BLOCK):
        above += tl.sum((_ordered(x_row, c + offs0, L) > thr).to(tl.int32))
    # write the indices above thr and the first K - above equal to it, in index order
    taken = tl.zeros((), dtype=tl.int32)
    equal_seen = tl.zeros((), dtype=tl.int32)
    for c in range(0, L, BLOCK):
        u = _ordered(x_row, c + offs0, L)
        eq = (u == thr).to(tl.int32)
        eq_rank = equal_seen + tl.cumsum(eq, 0) - eq
        pick = ((u > thr) | ((eq == 1) & (eq_rank < K - above))).to(tl.int32)
        slot = taken + tl.cumsum(pick, 0) - pick
        tl.store(out_row + slot, (c + offs0).to(tl.int64), mask=(pick == 1) & (slot < K))  # never past the row
        taken += tl.sum(pick)
        equal_seen += tl.sum(eq)


def topk_indices_triton(x: torch.Tensor, k: int) -> torch.Tensor:
    """Triton version of :func:`topk_indices_ref` (indices in index order; ties: the lowest); one
    program per row."""
    length = x.shape[-1]
    assert 0 <= k <= length, f"k {k} outside 0..{length}"
    x2 = x.reshape(-1, length)
    assert x2.stride(-1) == 1, "x needs a unit stride in its last dimension"
    out = torch.empty((x2.shape[0], k), dtype=torch.int64, device=x.device)
    if x2.shape[0] and k:
        block = min(next_pow2(length), _MAX_BLOCK)
        _topk_kernel[(x2.shape[0],)](x2, out, length, k, x2.stride(0), out.stride(0), BLOCK=block,
                                     num_warps=8 if block >= 2048 else 4)
    return out.reshape(*x.shape[:-1], k)


def topk_indices(x: torch.Tensor, k: int, force_triton: bool = False) -> torch.Tensor:
    """The indices [..., k] (int64) of the k largest of x [..., L] along its last dimension, as a set
    (see the module docstring; x fp32 or bf16). `force_triton`: the interpreter (tests only)."""
    if as_op():
        return topk_indices_op(x, k)
    if use_triton(x, force=force_triton):
        return topk_indices_triton(x, k)
    return topk_indices_ref(x, k)


@torch.library.custom_op("glm5mtp::topk_indices", mutates_args=())
def topk_indices_op(x: torch.Tensor, k: int) -> torch.Tensor:
    if use_triton(x):
        return topk_indices_triton(x, k)
    return topk_indices_ref(x, k).contiguous()


@topk_indices_op.register_fake
def _(x, k):
    return x.new_empty((*x.shape[:-1], k), dtype=torch.int64)

