"""What the engine asks of a model family, and nothing more.

A family turns a config.json into a config object, names its per-sequence state components with
their sizes, builds its target and MTP layer (on the meta device, for the loader to fill), shards
them over ranks, and hands the engine what its MTP head drafts with. The engine, the loader and the
diagnostics only ever see these; none of them names a model.

State components are of two kinds. `rows`: paged rows that grow with the tokens a sequence holds
(KV caches, indexer keys), rolled back by dropping rows past the accepted prefix. `slot`: one
fixed-size state per sequence whatever its length (a recurrent state), rolled back by the family's
model, which keeps what it needs (per-position states or a checkpoint) inside the slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from glm5mtp_cli.core.dtypes import dtype_bytes

if TYPE_CHECKING:  # no torch until a model is built: `info` reads the config alone
    import torch

ROWS = "rows"
SLOT = "slot"


@dataclass(frozen=True)
class StateComponent:
    """One per-sequence state component of one owner ("target" or "drafter")."""

    name: str  # ledger name, e.g. "target_mla"; unique within a run
    owner: str  # "target" | "drafter"
    kind: str  # ROWS | SLOT
    layers: int  # model layers holding this component
    shape: tuple[int, ...]  # per layer: one row's (width,) for ROWS, the whole state for SLOT
    dtype: str  # the element type's name, as torch names it ("bfloat16"; core/dtypes.py)

    @property
    def short(self) -> str:
        """The name without its owner ("mla"), as the model's forward knows it."""
        return self.name.split("_", 1)[1]

    @property
    def unit_bytes(self) -> int:
        """Bytes of one row (ROWS) or of one sequence's slot (SLOT), all layers together."""
        return self.layers * math.prod(self.shape) * dtype_bytes(self.dtype)

    def bytes_for(self, tokens: int, block_size: int = 1) -> int:
        """Bytes one sequence holds when it reserves `tokens` rows (whole blocks for ROWS)."""
        if self.kind == SLOT:
            return self.unit_bytes
        return math.ceil(tokens / block_size) * block_size * self.unit_bytes


@dataclass(frozen=True)
class MtpParts:
    """What the engine's MTP head (engine/mtp_head.py) drafts with: the family's MTP layer, the
    target's embedding and head it shares, and whether a draft chains on the normed hidden."""

    layer: Any  # nn.Module: the MTP layer
    embed: Any  # nn.Module: the target's embed_tokens
    head: Any  # nn.Module: the target's lm_head
    carry_normed: bool


class ModelFamily(Protocol):
    """One model family (GLM-5, GLM-5-Next, ...), selected by its config's model_type."""

    name: str
    model_types: tuple[str, ...]
    compile_default: str  # --compile without the flag: off | kernels | torch (engine/compiled.py; optional)
    # its byte formulas for diagnostics/sizing (models/glm5/sizing.py is the model): draft_step_bytes,
    # target_step_bytes, scratch_bytes, verify_record_bytes, TP_NOTES
    sizing: Any
    mla_cache_layouts: bool  # `info` compares its MLA cache's bf16 and fp8 layouts (REFERENCE section 5)

    def parse_config(self, raw: dict[str, Any], source: str) -> Any: ...
    # per rank: `tp` ranks each hold their share of head-split state (a KDA state's heads); rows and
    # replicated state are whole on every rank; dtype: a torch dtype or its name (the components hold names)
    def state_components(self, cfg, dtype: torch.dtype | str, with_drafter: bool = True, tp: int = 1) -> list[StateComponent]: ...
    def tensor_shapes(self, cfg) -> list[tuple[str, tuple[int, ...]]]: ...
    def mtp_prefix(self, cfg) -> str: ...
    def build_target(self, cfg) -> torch.nn.Module: ...
    def build_mtp(self, cfg) -> torch.nn.Module: ...
    def keeps_fp32(self, name: str) -> bool: ...  # checkpoint tensors held in fp32 whatever the dtype
    def check_tp(self, cfg, tp: int) -> None: ...
    def split_over_ranks(self, name: str) -> bool: ...  # whether --tp splits a checkpoint tensor  # one UserError line when cfg cannot split tp (> 1) ways
    def shard_target(self, model, comm): ...
    def shard_mtp(self, layer, comm, prefix: str): ...
    def mtp_parts(self, target, mtp) -> MtpParts: ...  # what the engine's MTP head drafts with
    # checkpoint bytes and `info`: how each tensor is stored and which component it counts under
    def component_of(self, cfg, name: str) -> str: ...
    def info_components(self, cfg) -> tuple[str, ...]: ...
    def stored_fp32(self, name: str) -> bool: ...
    def is_fp8_quantized(self, cfg, name: str, shape: tuple[int, ...]) -> bool: ...  # what its FP8 checkpoints quantize
    def config_dict(self, cfg, quantization: dict | None) -> dict[str, Any]: ...  # config.json beside written weights
    # bench's baseline: transformers' model of this family on the checkpoint in `folder` (target only)
    def transformers_model(self, folder: str, dtype: torch.dtype) -> torch.nn.Module: ...


def refuse_tree(plan) -> None:
    """A target whose rows attend causally verifies a chain of drafts only: a tree's rows must see their
    ancestors alone (plan: an engine verify plan, or None for a plain forward)."""
    if plan is not None and not plan.is_chain:
        raise NotImplementedError("this model verifies chains of drafts only, as yet")
