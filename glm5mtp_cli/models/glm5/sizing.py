"""GLM-5's byte formulas (diagnostics/sizing asks the family for them): the weights and cache one
batch-1 draft or target decode step reads (the memory floors of `bench`), a verify's transient
bytes on the PyTorch path, the notes of profile's tp table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glm5mtp_cli.models.bytes import head_bytes, rank_share, tensor_bytes
from glm5mtp_cli.core.dtypes import dtype_bytes
from glm5mtp_cli.models.glm5 import layout

if TYPE_CHECKING:  # no torch until a model is built: `info` reads the config alone
    import torch


def _active_layer_bytes(cfg, layer: int | None, elem_bytes: int, tp: int = 1) -> int:
    """Bytes of one layer's weights a batch-1 token reads on one of `tp` ranks: every tensor (this
    rank's slice of a split one), but only the chosen experts (a rank holds E/tp experts: on average
    top-k/tp of them); an FP8 checkpoint's quantized matrices at 1 byte plus their block scales (as
    loaded, models/fp8.py)."""
    block = cfg.fp8_block if getattr(cfg, "fp8", False) else None
    total = 0
    for name, shape in layout.tensor_shapes(cfg, layer).items():
        b = tensor_bytes(cfg, name, shape, elem_bytes, block, held=True)
        if ".mlp.experts." in name:
            b = b * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += rank_share(cfg, name, b, tp)
    return total


def _cache_read_bytes(cfg, layer: int, elem_bytes: int, context: int) -> int:
    """Cache bytes one query reads in a layer: every indexer key (a full layer), the selected latents."""
    keys = context * cfg.index_head_dim if cfg.has_indexer(layer) else 0
    return (keys + min(context, cfg.index_topk) * cfg.kv_cache_width) * elem_bytes


def draft_step_bytes(cfg, elem_bytes: int, context: int, draft_vocab: int | None = None, tp: int = 1) -> dict:
    """Bytes one chained draft step reads at batch 1 on one of `tp` ranks (the floor's numerator):
    its share of the split weights; the MLA latent and indexer rows whole (replicated on every rank)."""
    weights = _active_layer_bytes(cfg, cfg.mtp_layer_index, elem_bytes, tp)
    head = head_bytes(cfg, draft_vocab or cfg.vocab_size, elem_bytes, tp)
    cache = _cache_read_bytes(cfg, cfg.mtp_layer_index, elem_bytes, context)
    return {"mtp_weights": weights, "lm_head": head, "cache": cache, "total": weights + head + cache}


def target_step_bytes(cfg, elem_bytes: int, context: int, tp: int = 1) -> dict:
    """Bytes one batch-1 decode step of the (truncated) target reads on one of `tp` ranks: its
    layers' active weights (its share of the split ones), one embedding row, the final norm and its
    share of the head, and each layer's cache reads, whole on every rank (GLM-5-Next: and its
    share of the KDA states, read and written)."""
    layers = sum(_active_layer_bytes(cfg, i, elem_bytes, tp) for i in range(cfg.num_hidden_layers))
    h = cfg.hidden_size
    top = 2 * h * elem_bytes + head_bytes(cfg, cfg.vocab_size, elem_bytes, tp)
    cache = sum(_cache_read_bytes(cfg, i, elem_bytes, context) for i in range(cfg.num_hidden_layers))
    return {"layer_weights": layers, "embed_norm_head": top, "cache": cache, "total": layers + top + cache}


def scratch_bytes(cfg, dtype: torch.dtype, context: int, gamma: int) -> int:
    """Transient bytes of one verify forward of gamma+1 rows at `context` cached rows: the peak of one
    layer (layers run one after another), read off the PyTorch attention path:
    gathered MLA rows [L, kv_width] + gathered indexer keys [L, index_dim] (model dtype),
    scores [T, heads, L] fp32 x2 (scores, masked softmax) + probs [T, heads, L] (model dtype),
    indexer scores [T, index_heads, L] fp32 x2, masks [T, L] bool x3, top-k ids [T, topk] int64,
    plus the verify's logits [T, vocab] and the hidden rows [T, hidden] x4."""
    d = dtype_bytes(dtype)
    t = gamma + 1
    L = context + t
    attn = (L * cfg.kv_cache_width * d + L * cfg.index_head_dim * d
            + t * cfg.num_attention_heads * L * (4 * 2 + d)
            + t * cfg.index_n_heads * L * 4 * 2 + 3 * t * L + t * min(cfg.index_topk, L) * 8)
    return attn + t * cfg.vocab_size * max(d, 4) + 4 * t * cfg.hidden_size * d


def verify_record_bytes(cfg, dtype: torch.dtype, rows: int) -> int:
    """What a verify graph keeps for the commit after it: nothing (every component rolls back by length)."""
    return 0


TP_NOTES = [
    "MLA latent cache (and the DSA indexer keys) are replicated on every rank, not split by heads: the latent "
    "is shared by all heads, as in vLLM's tensor parallel MLA; per-sequence cache per GPU equals the tp 1 value.",
    "weights/GPU: q_b/kv_b/o_proj split by heads, routed experts E/N per rank, shared expert and dense MLPs "
    "column/row split, embed_tokens and lm_head split by vocabulary; q_a/kv_a, norms, router, DSA indexer, "
    "eh_proj replicated. fp8: quantized matrices 1 byte + fp32 scale per 128x128 block (as served).",
    "max seqs = (gpu-mem - weights/GPU) // bytes per sequence (cache + one verify's scratch + CUDA-graph "
    "buffers; no other reserve)."]
