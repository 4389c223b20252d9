"""What a cached forward reads of its sequences' state: per row component the pool, the slots the new
rows go to and the slots of every cached row (CachedRows); per fixed-size component the pool and each
sequence's slot (CachedSlots). The engine's caches (engine/cache.py) hold the pools; an eager forward
builds these views from its caches (cached_rows, cached_slots), a static one from the runner's buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from glm5mtp_cli.core.host_copy import to_device
from kernels.table_slots import table_slots


@dataclass
class CachedRows:
    """One component's (MLA latent or indexer keys) side of a cached forward: the pool, the slots
    the B x T new rows go to [B*T], and the slots of every sequence's rows 0..L-1 [B, L] (past a
    sequence's own length they point anywhere; the caller masks those keys like future ones)."""

    data: torch.Tensor  # the pool's [layers, slots, width]
    new: torch.Tensor
    all: torch.Tensor

    def write(self, layer: int, rows: torch.Tensor) -> None:
        """Append rows [B, T, W] at the new slots."""
        pool_write(self.data, layer, self.new, rows)

    def write_read(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Append rows [B, T, W] at the new slots, then read rows 0..L-1 of each sequence: [B, L, W]."""
        self.write(layer, rows)
        return self.data[layer].index_select(0, self.all.reshape(-1)).view(*self.all.shape, -1)


def pool_write(data: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """data[layer, slots[i]] = row i of rows [..., W]. Inside a compiled forward (engine/compiled.py)
    through the write_rows op: an op that declares its write lets inductor write the pool in place;
    index_copy_ on a view of the pool made it copy the whole pool layer for the reads that follow,
    every layer of every forward."""
    if torch.compiler.is_compiling():
        write_rows(data, layer, slots, rows)
    else:
        write_rows_(data, layer, slots, rows)


def write_rows_(data: torch.Tensor, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    view = data[layer]
    view.index_copy_(0, slots, rows.reshape(-1, rows.shape[-1]).to(view.dtype))


write_rows = torch.library.custom_op("glm5mtp::write_rows", write_rows_, mutates_args=("data",))


@dataclass
class CachedSlots:
    """One fixed-size component's (a recurrent state) side of a cached forward: the pool's data
    [layers, slots, *shape] and the slot of each of the B sequences [B] on the device, so a forward
    reads its sequences' states with no host value (a static forward's padding rows name a scratch
    slot). Forwards only read through it; what they advance is committed after (Target.commit)."""

    data: torch.Tensor
    index: torch.Tensor

    def read(self, layer: int) -> torch.Tensor:
        """Each sequence's state of `layer`: [B, *shape] (a copy; the pool stays as it was)."""
        return self.data[layer].index_select(0, self.index)


def cached_slots(caches: list, device) -> dict[str, CachedSlots]:
    """Eager forwards: the CachedSlots of every fixed-size component of `caches` (reserved by
    cached_rows' prepare)."""
    return {name: CachedSlots(ref.pool.data, to_device([c.slots[name].slot for c in caches], device))
            for name, ref in caches[0].slots.items()}


def cached_rows(caches: list, t: int, device) -> tuple[torch.Tensor, dict[str, CachedRows]]:
    """Eager forwards: (each sequence's cached length on the device, the CachedRows of every row
    component) for appending t rows to each of `caches`, reading each sequence's rows through its
    block table padded to the batch's longest."""
    for cache in caches:
        cache.prepare(t)
    lengths = [c.length for c in caches]
    starts = to_device(lengths, device)
    rows = {}
    for name in caches[0].rows:
        paged = [c.rows[name] for c in caches]
        bs = paged[0].pool.block_size
        blocks = math.ceil((max(lengths) + t) / bs)
        table = torch.stack([p.padded_table(blocks) for p in paged])
        new, all_ = table_slots(table, bs, starts, t)
        rows[name] = CachedRows(paged[0].pool.data, new, all_)
    return starts, rows
