"""Per-sequence state: pools per state component, per-sequence block tables and slots, byte ledger.

The components are the model family's (models/family.py). A row component's pool holds its rows
for all of its layers: data[layer, num_blocks * block_size, width]; a sequence owns a list of block
ids, and its row p lives at slot table[p // bs] * bs + p % bs. A fixed-size component's pool holds
one slot per sequence: data[layer, slot, *shape]. Blocks and slots are taken when a sequence
reserves capacity and given back when it is released, so the pools' `blocks_held` is the ledger
that leak-check and profile read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
import torch

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models import family_of
from glm5mtp_cli.models.family import SLOT
from kernels.table_slots import table_slots

class PoolExhausted(UserError):
    """A request needs more cache blocks than the pool has free."""


class BlockPool:
    def __init__(self, name: str, num_layers: int, width: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.name = name
        self.num_layers = num_layers
        self.width = width
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.data = torch.zeros(num_layers, num_blocks * block_size, width, dtype=dtype, device=device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def shape(self) -> tuple[int, ...]:
        """One row's shape (the component's per-layer shape)."""
        return (self.width,)

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.block_size * self.width * self.data.element_size()

    @property
    def blocks_held(self) -> int:
        return len(self._held)

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.bytes_per_block

    @property
    def bytes_total(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(
                f"{self.name} cache pool exhausted: need {n} blocks of {self.block_size} tokens, "
                f"{len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        self._held.update(blocks)
        return blocks

    def give(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._held:
                raise RuntimeError(f"{self.name}: block {b} freed twice or never taken")
            self._held.remove(b)
            self._free.append(b)


class PagedRows:
    """One sequence's rows of one component."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self._table: torch.Tensor | None = None  # the blocks on the device, for eager forwards (padded_table)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def reserve(self, tokens: int) -> None:
        need = math.ceil(tokens / self.pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.take(need)
            self._table = None

    def padded_table(self, num_blocks: int) -> torch.Tensor:
        """The first num_blocks block ids, padded with block 0's id (reads there are masked). Built on
        the device at the first eager read after a reserve: a sequence under graphs never needs it,
        and a copy per component and reserve was an admission's host time."""
        if self._table is None:
            self._table = to_device(self.blocks, self.pool.data.device)
        have = self._table.shape[0]
        if have >= num_blocks:
            return self._table[:num_blocks]
        return torch.cat([self._table, self._table[:1].expand(num_blocks - have)])

    def release(self) -> None:
        if self.blocks:
            self.pool.give(self.blocks)
        self.blocks = []
        self._table = None


def to_device(values: list[int], device: torch.device | str) -> torch.Tensor:
    """Host ints as a long tensor on `device` without a host sync: on CUDA the copy goes through
    pinned memory asynchronously (a plain copy from pageable memory waits for the stream)."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_ints(dst: torch.Tensor, values) -> None:
    """dst (a long tensor) takes host ints (nested lists in its shape) without a host sync, in one
    copy: on CUDA straight from pinned memory (to_device and a copy_ would be two)."""
    src = torch.tensor(values, dtype=torch.long)
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)


def copy_ints_many(writes: list[tuple[torch.Tensor, list[int] | None, list[int]]]) -> None:
    """Host ints into several long tensors of one device in one host-to-device copy: for each
    (dst, rows, values), dst takes values (flat, row-major) in its shape, or with rows, its rows
    `rows` take them, in that order. Then one device copy per write: a copy_ints per table row
    (three host calls each) was a third of an admission's host time at batch 64 (H100)."""
    flat: list[int] = []
    for _, rows, values in writes:
        flat += (rows or []) + values
    if not flat:
        return
    staged = to_device(flat, writes[0][0].device)
    at = 0
    for dst, rows, values in writes:
        if rows:
            idx = staged[at:at + len(rows)]
            at += len(rows)
            dst.index_copy_(0, idx, staged[at:at + len(values)].view(len(rows), *dst.shape[1:]))
        else:
            dst.copy_(staged[at:at + len(values)].view(dst.shape))
        at += len(values)


class SlotPool:
    """One fixed-size state component (a recurrent state) for all of its layers: data[layer,
    slot, *shape]; a sequence holds one slot whatever its length."""

    def __init__(self, name: str, num_layers: int, shape: tuple[int, ...], num_slots: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.name = name
        self.num_layers = num_layers
        self.data = torch.zeros(num_layers, num_slots, *shape, dtype=dtype, device=device)
        self.slot_bytes = self.data[:, 0].numel() * self.data.element_size()
        self.shape = tuple(shape)
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: set[int] = set()

    @property
    def blocks_held(self) -> int:
        return len(self._held)

    @property
    def bytes_held(self) -> int:
        return self.blocks_held * self.slot_bytes

    @property
    def bytes_total(self) -> int:
        return self.num_slots * self.slot_bytes

    def take(self) -> int:
        if not self._free:
            raise PoolExhausted(f"{self.name} state pool exhausted: all {self.num_slots} slots held")
        slot = self._free.pop()
        self._held.add(slot)
        self.data[:, slot].zero_()  # a new sequence starts from the zero state
        return slot

    def give(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"{self.name}: slot {slot} freed twice or never taken")
        self._held.remove(slot)
        self._free.append(slot)


class SlotRef:
    """One sequence's slot of one fixed-size component (taken on the first reserve)."""

    def __init__(self, pool: SlotPool):
        self.pool = pool
        self.slot: int | None = None

    def reserve(self, tokens: int) -> None:
        if self.slot is None:
            self.slot = self.pool.take()

    def release(self) -> None:
        if self.slot is not None:
            self.pool.give(self.slot)
        self.slot = None

    @property
    def bytes_held(self) -> int:
        return self.pool.slot_bytes if self.slot is not None else 0


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


class SequenceCache:
    """One model's (target or drafter) per-sequence state: paged rows per component ("mla",
    "indexer", ...) and fixed-size slots per component. `length` is the rows the sequence holds.

    Rollback. Truncating `length` is the whole rollback for rows. A fixed-size state cannot be cut
    back: the target's explicit commit (Target.commit, after its forward) keeps the accepted prefix
    of the forward's rows, and the truncate to that prefix then only moves the length. So a cache
    with slots rolls back only into its last forward, and only once."""

    def __init__(self, rows: dict[str, PagedRows], slots: dict[str, SlotRef] | None = None):
        self.rows = rows
        self.slots = slots or {}
        self.length = 0
        self.released = False
        self.forward_from: int | None = None  # slots: the length before the last forward, until a truncate
        self._capacity = self._least_capacity()

    @property
    def capacity(self) -> int:
        """Rows the reservation holds. Kept, not recomputed: blocks change only in reserve and
        release, and the engine reads it several times per sequence per step."""
        return self._capacity

    def _least_capacity(self) -> int:
        return min(r.capacity for r in self.rows.values()) if self.rows else 1 << 62

    def reserve(self, tokens: int) -> None:
        for part in (*self.rows.values(), *self.slots.values()):
            part.reserve(tokens)
        self._capacity = self._least_capacity()

    def prepare(self, num_new: int) -> None:
        """Room for num_new more rows, before a forward appends them; grows the reservation only if
        the budget was exceeded."""
        if self.slots:
            self.forward_from = self.length
        end = self.length + num_new
        if end > self.capacity:
            self.reserve(end)

    def truncate(self, length: int) -> None:
        """Drop rows past `length` (they are overwritten by the next append)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        if self.slots and self.forward_from is None and length < self.length:
            raise ValueError(f"a fixed-size state cannot roll back from {self.length} rows to {length}: "
                             "only into its last forward")
        if self.forward_from is not None and length < self.forward_from:
            raise ValueError(f"cannot roll back to {length} rows, before the last forward ({self.forward_from})")
        self.forward_from = None
        self.length = length

    def release(self, keep: str | None = None) -> None:
        """Give every block and slot back (except component `keep`: leak-check's self-test). Safe
        to call twice."""
        for name, part in (*self.rows.items(), *self.slots.items()):
            if name != keep:
                part.release()
        self.forward_from = None
        self.length = 0
        self.released = True
        self._capacity = self._least_capacity()

    def bytes_held(self) -> dict[str, int]:
        out = {name: len(r.blocks) * r.pool.bytes_per_block for name, r in self.rows.items()}
        out.update({name: s.bytes_held for name, s in self.slots.items()})
        return out


@dataclass
class CachePools:
    """The pools of a run, one per state component of the model family (models/family.py):
    block pools for components that grow with tokens, slot pools for fixed-size ones."""

    pools: dict[str, BlockPool | SlotPool] = field(default_factory=dict)
    owners: dict[str, list[str]] = field(default_factory=dict)  # "target" -> its component names

    @classmethod
    def create(cls, cfg, num_blocks: int, block_size: int, dtype: torch.dtype,
               device: torch.device | str, with_drafter: bool = True, tp: int = 1,
               num_slots: int | None = None) -> "CachePools":
        """Pools for `num_blocks` blocks per row component; slot components get `num_slots` slots
        (default one per block, which is never fewer than the sequences the block pools can hold).
        tp: the ranks the model is sharded over (a rank's pools hold its share of head-split state)."""
        pools, owners = {}, {}
        for c in family_of(cfg).state_components(cfg, dtype, with_drafter, tp=tp):
            dt = getattr(torch, c.dtype)  # a component names its dtype (sizes need no torch)
            if c.kind == SLOT:
                pools[c.name] = SlotPool(c.name, c.layers, c.shape, num_slots or num_blocks, dt, device)
            else:
                pools[c.name] = BlockPool(c.name, c.layers, c.shape[0], block_size, num_blocks, dt, device)
            owners.setdefault(c.owner, []).append(c.name)
        return cls(pools, owners)

    def sequence_cache(self, owner: str) -> SequenceCache:
        rows, slots = {}, {}
        for name in self.owners[owner]:
            short = name[len(owner) + 1:]
            pool = self.pools[name]
            if isinstance(pool, SlotPool):
                slots[short] = SlotRef(pool)
            else:
                rows[short] = PagedRows(pool)
        return SequenceCache(rows, slots)

    def target_cache(self) -> SequenceCache:
        return self.sequence_cache("target")

    def drafter_cache(self) -> SequenceCache:
        return self.sequence_cache("drafter")

    def blocks_held(self) -> dict[str, int]:
        return {name: p.blocks_held for name, p in self.pools.items()}

    def bytes_held(self) -> dict[str, int]:
        return {name: p.bytes_held for name, p in self.pools.items()}

    def bytes_total(self) -> int:
        return sum(p.bytes_total for p in self.pools.values())
