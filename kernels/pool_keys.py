"""GLM-5-Next's pooled indexer keys over the engine's pools (models/glm5_next/paged.py): the keys of
the pools a forward's new rows complete, written into the pool component, as one kernel.

A pooled key is sum_j softmax_j(gate[pP+j] + ape[j]) * key[pP+j] over its pool's P raw (key, gate)
rows, stored split over the pool's P rows of the pool component (row pP+j holds columns
j*di/P..(j+1)*di/P-1). PyTorch's form is about 25 launches per indexed layer and forward (the
window's positions, the members' gather from every raw row of the sequence, the softmax and the
weighted sum, the chunk's gather, the old values read back for the pools not completed now);
here one program per sequence and window position reads its pool's P raw rows through the table
and writes its chunk, only where the pool is complete now and was not before.
"""

import torch

from ._triton import jit, next_pow2, tl, use_triton


def pool_keys_ref(raw: torch.Tensor, ape: torch.Tensor, pool: int) -> torch.Tensor:
    """K̄_p[c] = sum_j softmax_j(gate[pP+j, c] + ape[j, c]) * key[pP+j, c] over raw [m*P, 2 di] ->
    [m, di]; softmax in fp32, then cast to the keys' dtype before the product and the sum."""
    di = ape.shape[-1]
    m = raw.shape[0] // pool
    grouped = raw[: m * pool].view(m, pool, 2 * di)
    keys, gates = grouped[..., :di], grouped[..., di:]
    probs = (gates.float() + ape.float()).softmax(dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def write_pool_keys_ref(pool: torch.Tensor, raw: torch.Tensor, layer: int, pool_slots: torch.Tensor,
                        raw_slots: torch.Tensor, starts: torch.Tensor, t: int, ape: torch.Tensor) -> None:
    """pool [layers, S, di/P], raw [layers, S', 2 di] (the new rows written): the pools of layer
    `layer` that the t new rows of each sequence complete get their keys' chunks at their rows'
    slots (pool_slots, raw_slots [B, L]: each sequence's rows 0..L-1, L >= starts + t). The window
    of t + P - 1 positions ending at each sequence's last new row covers every such pool; positions
    before 0 clamp to 0 and pools complete before keep what they hold (rewritten unchanged)."""
    P = ape.shape[0]
    b, length = pool_slots.shape
    dev = starts.device
    rows = raw[layer].index_select(0, raw_slots.reshape(-1)).view(b, length, -1)
    pos = (starts[:, None] - (P - 1) + torch.arange(t + P - 1, device=dev)).clamp(min=0)  # [B, W]
    base = pos // P * P
    members = (base[..., None] + torch.arange(P, device=dev)).clamp(max=length - 1)      # [B, W, P]
    grouped = rows.gather(1, members.reshape(b, -1, 1).expand(-1, -1, rows.shape[-1]))
    keys = pool_keys_ref(grouped.reshape(-1, rows.shape[-1]), ape, P)                    # [B*W, di]
    chunks = keys.view(b, pos.shape[1], P, -1)
    chunk = chunks.gather(2, (pos % P)[..., None, None].expand(-1, -1, 1, chunks.shape[-1])).squeeze(2)
    data = pool[layer]
    slots = pool_slots.gather(1, pos.clamp(max=length - 1)).reshape(-1)
    old = data.index_select(0, slots).view(*pos.shape, -1)
    n = starts[:, None]
    fresh = (base + P <= n + t) & (base >= n // P * P)  # complete now, and not before
    data.index_copy_(0, slots, torch.where(fresh[..., None], chunk.to(data.dtype), old).reshape(len(slots), -1))


@jit
def _pool_keys_kernel(pool_ptr, raw_ptr, ape_ptr, pool_slots_ptr, raw_slots_ptr, starts_ptr, T, L, CW,
                      P: tl.constexpr, DI: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    n = tl.load(starts_ptr + b)
    pos = tl.maximum(n - (P - 1) + w, 0)
    base = pos // P * P
    if (base + P <= n + T) & (base >= n // P * P):  # complete now, and not before
        cols = (pos % P) * CW + tl.arange(0, BLOCK)  # this row's chunk of the pooled key
        cm = tl.arange(0, BLOCK) < CW
        dt = raw_ptr.dtype.element_ty
        top = tl.full((BLOCK,), float("-inf"), tl.float32)
        for j in tl.static_range(P):
            row = raw_ptr + tl.load(raw_slots_ptr + b * L + base + j) * (2 * DI)
            gate = tl.load(row + DI + cols, mask=cm, other=0.0).to(tl.float32)
            top = tl.maximum(top, gate + tl.load(ape_ptr + j * DI + cols, mask=cm, other=0.0).to(tl.float32))
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(P):
            row = raw_ptr + tl.load(raw_slots_ptr + b * L + base + j) * (2 * DI)
            gate = tl.load(row + DI + cols, mask=cm, other=0.0).to(tl.float32)
            total += tl.exp(gate + tl.load(ape_ptr + j * DI + cols, mask=cm, other=0.0).to(tl.float32) - top)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(P):
            row = raw_ptr + tl.load(raw_slots_ptr + b * L + base + j) * (2 * DI)
            gate = tl.load(row + DI + cols, mask=cm, other=0.0).to(tl.float32)
            prob = tl.exp(gate + tl.load(ape_ptr + j * DI + cols, mask=cm, other=0.0).to(tl.float32) - top) / total
            key = tl.load(row + cols, mask=cm, other=0.0)
            acc += (prob.to(dt) * key).to(tl.float32)  # the reference's product, rounded to the keys' dtype
        dst = pool_ptr + tl.load(pool_slots_ptr + b * L + pos) * CW + tl.arange(0, BLOCK)
        tl.store(dst, acc.to(dt).to(pool_ptr.dtype.element_ty), mask=cm)


def write_pool_keys_triton(pool, raw, layer, pool_slots, raw_slots, starts, t, ape):
    P, di = ape.shape
    b, length = pool_slots.shape
    cw = pool.shape[-1]
    if b and t:
        _pool_keys_kernel[(b, t + P - 1)](pool[layer], raw[layer], ape.contiguous(), pool_slots.contiguous(),
                                          raw_slots.contiguous(), starts.contiguous(), t, length, cw,
                                          P=P, DI=di, BLOCK=next_pow2(cw))


def write_pool_keys(pool, raw, layer: int, pool_slots, raw_slots, starts, t: int, ape,
                    force_triton: bool = False) -> None:
    """write_pool_keys_ref's writes; the Triton kernel for CUDA tensors (or `force_triton` in the
    interpreter). Compiled forwards call the op on every path: traced, the reference's in-place write
    into a view of the pool made inductor copy the whole pool layer (engine/cache.pool_write)."""
    if torch.compiler.is_compiling():
        write_pool_keys_op(pool, raw, layer, pool_slots, raw_slots, starts, t, ape)
    elif use_triton(pool, raw, starts, force=force_triton):
        write_pool_keys_triton(pool, raw, layer, pool_slots, raw_slots, starts, t, ape)
    else:
        write_pool_keys_ref(pool, raw, layer, pool_slots, raw_slots, starts, t, ape)


# As a custom op for compiled forwards (_triton's docstring): it declares its write to the pool.
@torch.library.custom_op("glm5mtp::write_pool_keys", mutates_args=("pool",))
def write_pool_keys_op(pool: torch.Tensor, raw: torch.Tensor, layer: int, pool_slots: torch.Tensor,
                       raw_slots: torch.Tensor, starts: torch.Tensor, t: int, ape: torch.Tensor) -> None:
    if use_triton(pool, raw, starts):
        write_pool_keys_triton(pool, raw, layer, pool_slots, raw_slots, starts, t, ape)
    else:
        write_pool_keys_ref(pool, raw, layer, pool_slots, raw_slots, starts, t, ape)
