"""Paged caches: block pools per component, per-sequence block tables, byte accounting.

A pool holds one component's rows (target MLA, target indexer keys, drafter MLA, drafter indexer
keys) for all of its layers: data[layer, num_blocks * block_size, width]. A sequence owns a list
of block ids per component; row p of the sequence lives at slot table[p // bs] * bs + p % bs.
Blocks are taken when a sequence reserves capacity and given back when it is released, so the
pools' `blocks_held` is the ledger that leak-check and profile read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from glm5mtp_cli.errors import UserError

if TYPE_CHECKING:  # annotations only: a runtime import would close the cycle cache -> models.glm5 -> decoder -> cache
    from glm5mtp_cli.models.glm5.config import ModelConfig

COMPONENTS = ("target_mla", "target_indexer", "drafter_mla", "drafter_indexer")


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
        self.table = torch.empty(0, dtype=torch.long, device=pool.data.device)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def reserve(self, tokens: int) -> None:
        need = math.ceil(tokens / self.pool.block_size) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.take(need)
            self.table = torch.tensor(self.blocks, dtype=torch.long, device=self.pool.data.device)

    def padded_table(self, num_blocks: int) -> torch.Tensor:
        """The first num_blocks block ids, padded with block 0's id (reads there are masked)."""
        have = self.table.shape[0]
        if have >= num_blocks:
            return self.table[:num_blocks]
        return torch.cat([self.table, self.table[:1].expand(num_blocks - have)])

    def release(self) -> None:
        if self.blocks:
            self.pool.give(self.blocks)
        self.blocks = []
        self.table = self.table[:0]


def to_device(values: list[int], device: torch.device | str) -> torch.Tensor:
    """Host ints as a long tensor on `device` without a host sync: on CUDA the copy goes through
    pinned memory asynchronously (a plain copy from pageable memory waits for the stream)."""
    t = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def table_slots(table: torch.Tensor, block_size: int, starts: torch.Tensor, num_new: int,
                scratch_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of a batch's rows from its block tables [B, NB] and cached lengths [B], on the device.

    Returns (slots of the num_new rows each sequence appends at starts[b].. [B * num_new],
    slots of rows 0..NB*block_size-1 of each sequence [B, NB * block_size]). A new row past the
    table's capacity (padding rows of a captured forward) goes to `scratch_block` when given.
    """
    pos = starts[:, None] + torch.arange(num_new, device=table.device)
    nb = table.shape[1]
    block = pos // block_size
    new = table.gather(1, block.clamp(max=nb - 1)) * block_size + pos % block_size
    if scratch_block is not None:
        new = torch.where(block < nb, new, scratch_block * block_size + pos % block_size)
    j = torch.arange(nb * block_size, device=table.device)
    return new.reshape(-1), table[:, j // block_size] * block_size + j % block_size


class SequenceCache:
    """One model's (target or drafter) cache of one sequence: MLA rows and indexer-key rows."""

    def __init__(self, mla: PagedRows, indexer: PagedRows | None):
        self.mla = mla
        self.indexer = indexer
        self.length = 0
        self.released = False

    @property
    def capacity(self) -> int:
        return self.mla.capacity

    def reserve(self, tokens: int) -> None:
        self.mla.reserve(tokens)
        if self.indexer is not None:
            self.indexer.reserve(tokens)

    def prepare(self, num_new: int) -> None:
        """Room for num_new more rows; grows the reservation only if the budget was exceeded."""
        end = self.length + num_new
        if end > self.capacity:
            self.reserve(end)

    def truncate(self, length: int) -> None:
        """Drop rows past `length` (they are overwritten by the next append)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        self.length = length

    def release(self) -> None:
        """Give every block back. Safe to call twice."""
        self.mla.release()
        if self.indexer is not None:
            self.indexer.release()
        self.length = 0
        self.released = True

    def bytes_held(self) -> dict[str, int]:
        out = {"mla": len(self.mla.blocks) * self.mla.pool.bytes_per_block}
        if self.indexer is not None:
            out["indexer"] = len(self.indexer.blocks) * self.indexer.pool.bytes_per_block
        return out


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, num_target_layers: int | None = None) -> dict[str, int]:
    """Cache bytes per token by component, predicted from the config (REFERENCE section 5)."""
    size = torch.empty(0, dtype=dtype).element_size()
    layers = cfg.num_hidden_layers if num_target_layers is None else num_target_layers
    full = sum(1 for i in range(layers) if cfg.has_indexer(i))
    return {
        "target_mla": layers * cfg.kv_cache_width * size,
        "target_indexer": full * cfg.index_head_dim * size,
        "drafter_mla": cfg.num_nextn_predict_layers * cfg.kv_cache_width * size,
        "drafter_indexer": cfg.num_nextn_predict_layers * cfg.index_head_dim * size,
    }


@dataclass
class CachePools:
    """The four block pools of a run: target and drafter, MLA and indexer keys."""

    pools: dict[str, BlockPool] = field(default_factory=dict)

    @classmethod
    def create(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
               device: torch.device | str, with_drafter: bool = True) -> "CachePools":
        full = sum(1 for i in range(cfg.num_hidden_layers) if cfg.has_indexer(i))
        specs = {"target_mla": (cfg.num_hidden_layers, cfg.kv_cache_width),
                 "target_indexer": (full, cfg.index_head_dim)}
        if with_drafter:
            specs["drafter_mla"] = (1, cfg.kv_cache_width)
            specs["drafter_indexer"] = (1, cfg.index_head_dim)
        return cls({name: BlockPool(name, layers, width, block_size, num_blocks, dtype, device)
                    for name, (layers, width) in specs.items()})

    def target_cache(self) -> SequenceCache:
        return SequenceCache(PagedRows(self.pools["target_mla"]), PagedRows(self.pools["target_indexer"]))

    def drafter_cache(self) -> SequenceCache:
        return SequenceCache(PagedRows(self.pools["drafter_mla"]), PagedRows(self.pools["drafter_indexer"]))

    def blocks_held(self) -> dict[str, int]:
        return {name: p.blocks_held for name, p in self.pools.items()}

    def bytes_held(self) -> dict[str, int]:
        return {name: p.bytes_held for name, p in self.pools.items()}

    def bytes_total(self) -> int:
        return sum(p.bytes_total for p in self.pools.values())
