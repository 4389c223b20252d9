"""GLM-5-Next (`glm5_next`, GLM-5.3-Flash): target + MTP layer, PyTorch path (CPU/CUDA, fp32/bf16).

One concern per module: config (NextConfig), layout (checkpoint names/shapes), mhc (streams),
kda (linear attention + its rollback records), indexer (pooled DSA), attention (NoPE MLA),
decoder (the target, verify/commit), state (per-sequence storage and byte sizes), mtp (the MTP
layer and its draft chain), load (lazy loading through CheckpointReader), bench_rollback (the
measurement behind decoder.DEFAULT_ROLLBACK).
"""

from .config import NextConfig
from .decoder import DEFAULT_ROLLBACK, Glm5NextForCausalLM, StepPending
from .mtp import DraftChain, Glm5NextMtpLayer
from .state import IndexedSlot, KdaSlot, SequenceState

__all__ = ["DEFAULT_ROLLBACK", "DraftChain", "Glm5NextForCausalLM", "Glm5NextMtpLayer", "IndexedSlot",
           "KdaSlot", "NextConfig", "SequenceState", "StepPending"]
