"""Per-sequence state: pools per state component, per-sequence block tables and slots, byte ledger.

The components are the model family's (core/family.py). A row component's pool holds its rows
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

from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.core.family import SLOT
from glm5mtp_cli.core.host_copy import to_device
from glm5mtp_cli.errors import UserError

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

    def move(self, src: list[int], dst: list[int]) -> None:
        """Rows at positions src to positions dst, every layer's (the sources read before any is written)."""
        bs = self.pool.block_size
        at = [[self.blocks[p // bs] * bs + p % bs for p in ps] for ps in (src, dst)]
        src_slots, dst_slots = (to_device(a, self.pool.data.device) for a in at)
        self.pool.data.index_copy_(1, dst_slots, self.pool.data.index_select(1, src_slots))


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

    def keep_path(self, start: int, rows: list[int]) -> None:
        """After a tree verify appended its rows at `start`: the accepted path's rows (their offsets
        past `start`, root left out) become rows start + 1, start + 2, ... (a chain's already are).
        A fixed-size state keeps its path through the target's commit, not here."""
        moved = [(start + r, start + 1 + k) for k, r in enumerate(rows) if r != k + 1]
        for part in self.rows.values():
            if moved:
                part.move(*map(list, zip(*moved)))

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
    """The pools of a run, one per state component of the model family (core/family.py):
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
