"""What one GLM-5-Next sequence holds between forwards: the model's own reference storage (the
engine keeps the same state in its pools, models/glm5_next/pooled.py; sizes come from the family's
state_components).

Components (REFERENCE-glm5next section 8, cache summary):
- `kda_state`   per KDA layer, fixed: the recurrent S [H, d, d], always fp32;
- `kda_conv`    per KDA layer, fixed: the last K-1 pre-conv q|k|v rows [K-1, 3 H d];
- `mla_latent`  per indexed layer (and the MTP layer), grows: one kv_lora_rank row per token;
- `index_pool`  per indexed layer, grows: one pooled key (index_head_dim) per complete pool of P
                tokens, i.e. index_head_dim / P values per token;
- `index_tail`  per indexed layer, fixed: the raw (key, gate) rows of the incomplete pool, P-1 rows.

Storage here is plain contiguous tensors per sequence with capacity reserved up front; the math
(kda.py, attention.py) never touches it: layers read views and return pending rows, and `apply`
writes what a commit keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5mtp_cli.models.glm5_next.attention import MlaCommit, MlaPast
from glm5mtp_cli.models.glm5_next.config import NextConfig


@dataclass
class KdaSlot:
    state: torch.Tensor    # [H, d, d] fp32
    window: torch.Tensor   # [K-1, 3C]

    @classmethod
    def alloc(cls, cfg: NextConfig, dtype, device) -> "KdaSlot":
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        return cls(torch.zeros(h, d, d, dtype=torch.float32, device=device),
                   torch.zeros(cfg.linear_conv_kernel_dim - 1, 3 * cfg.linear_dim, dtype=dtype, device=device))

    def apply(self, state: torch.Tensor, window: torch.Tensor) -> None:
        self.state.copy_(state)
        self.window.copy_(window)


@dataclass
class IndexedSlot:
    """One indexed layer's rows: latent [cap, R], pooled [cap // P, di], tail [P-1, 2 di]."""

    latent: torch.Tensor
    pooled: torch.Tensor
    tail: torch.Tensor
    pool: int
    length: int = 0

    @classmethod
    def alloc(cls, cfg: NextConfig, capacity: int, dtype, device) -> "IndexedSlot":
        P, di = cfg.index_kpool, cfg.index_head_dim
        return cls(torch.zeros(capacity, cfg.kv_lora_rank, dtype=dtype, device=device),
                   torch.zeros(capacity // P, di, dtype=dtype, device=device),
                   torch.zeros(max(P - 1, 0), 2 * di, dtype=dtype, device=device), P)

    @property
    def capacity(self) -> int:
        return self.latent.shape[0]

    def past(self) -> MlaPast:
        n, P = self.length, self.pool
        return MlaPast(self.latent[:n], self.pooled[: n // P], self.tail[: n % P])

    def apply(self, c: MlaCommit) -> None:
        """Write an MlaCommit: latent rows, completed pools, the new tail; length grows to match."""
        n = c.start + c.latent.shape[0]
        if n > self.capacity:
            raise ValueError(f"sequence state holds {self.capacity} rows; {n} needed")
        self.latent[c.start:n].copy_(c.latent)
        self.pooled[c.pool_start:c.pool_start + c.pooled.shape[0]].copy_(c.pooled)
        self.tail[: c.tail.shape[0]].copy_(c.tail)
        self.length = n


@dataclass
class SequenceState:
    """The target's per-sequence state: one slot per KDA layer and per indexed layer."""

    kda: dict[int, KdaSlot] = field(default_factory=dict)
    indexed: dict[int, IndexedSlot] = field(default_factory=dict)
    length: int = 0

    @classmethod
    def alloc(cls, cfg: NextConfig, capacity: int, dtype=torch.float32, device="cpu") -> "SequenceState":
        st = cls()
        for i in cfg.kda_layers:
            st.kda[i] = KdaSlot.alloc(cfg, dtype, device)
        for i in cfg.indexed_layers:
            st.indexed[i] = IndexedSlot.alloc(cfg, capacity, dtype, device)
        return st

    def nbytes(self) -> int:
        out = 0
        for s in self.kda.values():
            out += s.state.nbytes + s.window.nbytes
        for s in self.indexed.values():
            out += s.latent.nbytes + s.pooled.nbytes + s.tail.nbytes
        return out
