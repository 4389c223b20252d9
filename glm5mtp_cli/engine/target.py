"""The Target protocol: what the engine, the runner and the runtime ask of a family's target model
(models/glm5/decoder.Glm5ForCausalLM, models/glm5_next/pooled.PooledTarget), and nothing more.

Every forward appends rows to SequenceCaches (engine/cache.py). The eager call reads and writes
them through their block tables; `forward_batch` is the same forward as a function of device
tensors alone over a `context` (what the runner runs over static buffers or captures in a CUDA
graph; engine/graphs.py). A target with fixed-size state (GLM-5-Next's KDA layers) whose context
takes the slot indices (`reads_slots`) can run as static forwards. Its forwards only read that
state and return in `out.pending` what they advanced; `commit(pending, kept)` then writes each
sequence's state after its first kept[b] rows, with kept a device tensor: no host value on the
way, so a commit can run inside a captured forward. Whoever runs a forward commits it (the
runner after a verify's accept, the prefill right after each forward); an uncommitted forward
leaves the state as it was.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Target(Protocol):
    cfg: object  # the family's config
    reads_slots: bool  # its context takes slot indices: its static forwards read fixed-size state

    @property
    def embed_tokens(self) -> nn.Embedding: ...
    @property
    def lm_head(self) -> nn.Linear: ...
    # eager: input_ids [B, T] appended to each cache; -> out.logits [B, R, V] for `rows` ("all",
    # "last" or a row per sequence [B]), out.hidden_all [B, T, H], out.pending (None without slot state);
    # real [B] (device, a shared prefill forward's): rows past real[b] are padding, which leaves no
    # trace in fixed-size state; the caller truncates the paged rows back to the real ones; plan (a
    # verify's, engine/verify.py): which earlier rows each row sees; None or a chain: causal rows
    def __call__(self, input_ids: torch.Tensor, caches: list, rows="all", real=None, plan=None): ...
    # the same forward over a runner's buffers: ctx = context(starts [B], t, rows[, slots])
    def context(self, starts: torch.Tensor, t: int, rows: dict, slots: dict | None = None): ...
    def forward_batch(self, input_ids: torch.Tensor, ctx, rows="all"): ...
    # pending: a forward's out.pending (None: nothing to commit); kept [B] long on the device: the rows
    # through each sequence's accepted one (a tree's: through its accepted path's last row)
    def commit(self, pending, kept: torch.Tensor) -> None: ...
