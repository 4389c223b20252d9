"""A grammar's token bitmask applied to logits: disallowed tokens to -inf, in place.

The bitmask is llguidance's packing (and vLLM's): int32 words [..., ceil(V / 32)], token t allowed
when bit t % 32 of word t // 32 is set. Applied before temperature and top-p, as vLLM applies it,
so a masked distribution is the renormalised restriction of the model's. Rows of `logits` and of
`bitmask` pair up one to one ([A, g + 1, V] verify logits with [A, g + 1, W] masks; [A, V'] draft
logits take masks already gathered to their draft vocabulary, see `unpack`).
"""

import torch

from ._triton import jit, tl, use_triton

BITS = 32


def words(vocab_size: int) -> int:
    """int32 words of one token mask over `vocab_size` tokens."""
    return (vocab_size + BITS - 1) // BITS


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., W] int32 -> [..., vocab_size] bool, True where allowed."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[..., :, None] >> shifts) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


def apply_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: logits [..., V] (any float dtype) masked in place by bitmask [..., W]
    (W >= ceil(V / 32); tokens past 32 W are disallowed). Returns logits."""
    allowed = unpack(bitmask, logits.shape[-1])
    return logits.masked_fill_(~allowed, float("-inf"))


@jit
def _bitmask_kernel(logits_ptr, mask_ptr, V, W, stride_l, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    word = tl.load(mask_ptr + row * stride_m + offs // 32, mask=inside & (offs // 32 < W), other=0)
    banned = ((word >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_l + offs, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty),
             mask=inside & banned)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`apply_bitmask_ref` (same arguments, same in-place result): one
    program per (row, block of tokens), storing only the banned entries."""
    v, w = logits.shape[-1], bitmask.shape[-1]
    assert logits.shape[:-1] == bitmask.shape[:-1], f"logits {tuple(logits.shape)} vs mask {tuple(bitmask.shape)}"
    assert bitmask.dtype == torch.int32, "the bitmask is int32 words"
    rows_l = logits if logits.dim() == 2 else logits.view(-1, v)  # in place: rows of the caller's tensor
    rows_m = bitmask.reshape(-1, w)  # a copy where strided (a verify of fewer rows than its buffer): small
    assert rows_l.stride(-1) == 1 and rows_m.stride(-1) == 1, "logits and bitmask need a unit last stride"
    block = 1024
    if rows_l.shape[0]:
        _bitmask_kernel[(rows_l.shape[0], (v + block - 1) // block)](rows_l, rows_m, v, w, rows_l.stride(0),
                                                                     rows_m.stride(0), BLOCK=block, num_warps=4)
    return logits


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, force_triton: bool = False) -> torch.Tensor:
    """Mask logits [..., V] in place by the packed bitmask [..., W]: the Triton kernel on CUDA,
    the reference elsewhere (force_triton: the kernel in the interpreter, tests only)."""
    flat = logits.dim() == 2 or logits.is_contiguous()  # rows the kernel can write in place
    if use_triton(logits, bitmask, force=force_triton) and flat and logits.stride(-1) == 1:
        return apply_bitmask_triton(logits, bitmask)
    return apply_bitmask_ref(logits, bitmask)
