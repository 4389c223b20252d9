"""The indices of each row's k largest values, as a set (DSA's indexer selection, MoE routing).

torch.topk on CUDA runs one radix select per row in a single block plus a gather (`sbtopk`): 17 us
for one 4096-wide row on the H200 (k 2048, GLM-5's index_topk), the draft step's costliest small
kernel after the GEMMs. The Triton kernel here holds a row (up to `MAX_LENGTH` values) in registers,
finds its k-th largest value two bits at a time from the top (each pass counts the values at or
above four candidates in one reduction), then writes the indices of the values above it and of as
many equal to it as k needs, in index order (ties at the boundary go to the lowest indices).
Callers use the result as a set, so index order costs nothing. Longer rows go to torch.topk.

Floats are compared through their bits mapped to unsigned integers in the same order (flip every
bit of a negative, the sign bit of a positive); -inf (masked keys) orders below every finite value.
NaN has no place in a ranking and is not expected.
"""

import torch

from ._triton import as_op, jit, next_pow2, tl, use_triton

MAX_LENGTH = 16384  # the longest row the kernel holds in registers (32 values per thread at 16 warps)


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
    offs = tl.arange(0, BLOCK)
    u = _ordered(x_ptr + row * stride_x, offs, L)  # the whole row, read once, held in registers
    # the k-th largest code: the largest thr with at least K codes >= thr, two bits per pass: of
    # thr + j * unit (j = 0..3; j = 0 always reaches K) the largest whose count still does
    j = tl.arange(0, 4).to(tl.uint32)
    thr = tl.zeros((), dtype=tl.uint32)
    unit = tl.full((), 1073741824, tl.uint32)
    for _ in range(16):
        cands = thr + j * unit
        counts = tl.sum((u[None, :] >= cands[:, None]).to(tl.int32), axis=1)
        thr = thr + tl.max(tl.where(counts >= K, j, tl.zeros_like(j)), axis=0) * unit
        unit = unit >> 2
    # the indices above thr and the first K - above equal to it, in index order
    above = tl.sum((u > thr).to(tl.int32))
    eq = (u == thr).to(tl.int32)
    pick = ((u > thr) | ((eq == 1) & (tl.cumsum(eq, 0) - eq < K - above))).to(tl.int32)
    slot = tl.cumsum(pick, 0) - pick
    tl.store(out_ptr + row * stride_o + slot, offs.to(tl.int64), mask=(pick == 1) & (slot < K))  # never past the row


def topk_indices_triton(x: torch.Tensor, k: int) -> torch.Tensor:
    """Triton version of :func:`topk_indices_ref` (indices in index order; ties: the lowest); one
    program per row, rows of at most `MAX_LENGTH`."""
    length = x.shape[-1]
    assert 0 <= k <= length <= MAX_LENGTH, f"k {k}, row length {length}: need k <= length <= {MAX_LENGTH}"
    x2 = x.reshape(-1, length)
    assert x2.stride(-1) == 1, "x needs a unit stride in its last dimension"
    out = torch.empty((x2.shape[0], k), dtype=torch.int64, device=x.device)
    if x2.shape[0] and k:
        block = next_pow2(length)
        _topk_kernel[(x2.shape[0],)](x2, out, length, k, x2.stride(0), out.stride(0), BLOCK=block,
                                     num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16))
    return out.reshape(*x.shape[:-1], k)


def topk_indices(x: torch.Tensor, k: int, force_triton: bool = False) -> torch.Tensor:
    """The indices [..., k] (int64) of the k largest of x [..., L] along its last dimension, as a set
    (see the module docstring; x fp32 or bf16). `force_triton`: the interpreter (tests only)."""
    if as_op():
        return topk_indices_op(x, k)
    if x.shape[-1] <= MAX_LENGTH and use_triton(x, force=force_triton):
        return topk_indices_triton(x, k)
    return topk_indices_ref(x, k)


@torch.library.custom_op("glm5mtp::topk_indices", mutates_args=())
def topk_indices_op(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] <= MAX_LENGTH and use_triton(x):
        return topk_indices_triton(x, k)
    return topk_indices_ref(x, k).contiguous()


@topk_indices_op.register_fake
def _(x, k):
    return x.new_empty((*x.shape[:-1], k), dtype=torch.int64)

