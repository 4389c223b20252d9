"""GLM-5-Next's byte formulas (diagnostics/sizing asks the family for them), one per component: a
layer's active weights, a KDA layer's state traffic, an indexed layer's cache reads; the decode
steps' floors, a verify's transient bytes and what a verify graph keeps for the KDA commit, the notes
of profile's tp table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glm5mtp_cli.models.bytes import head_bytes, rank_share, tensor_bytes
from glm5mtp_cli.core.dtypes import dtype_bytes
from glm5mtp_cli.models.glm5_next import layout as next_layout

if TYPE_CHECKING:  # no torch until a model is built: `info` reads the config alone
    import torch


def _active_layer_bytes(cfg, layer: int, elem_bytes: int, tp: int = 1) -> int:
    """Weights of trunk layer `layer` (or the MTP layer) one batch-1 token reads on one of `tp` ranks:
    every tensor (mHC, KDA or MLA with its indexer, router, shared expert, dense MLP; this rank's
    slice of a split one), of the routed experts only the top-k chosen (top-k/tp a rank on average); fp32 for what the model keeps in fp32; an FP8 checkpoint's quantized matrices at
    1 byte plus their block scales (as loaded, models/fp8.py)."""
    shapes = next_layout.mtp_shapes(cfg) if layer == cfg.mtp_layer_index else next_layout.layer_shapes(cfg, layer)
    block = cfg.fp8_block if cfg.fp8 else None
    total = 0
    for name, shape in shapes.items():
        full = next_layout.layer_prefix(layer) + name
        b = tensor_bytes(cfg, full, shape, elem_bytes, block, held=True)
        if name.startswith("mlp.experts."):
            b = b * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += rank_share(cfg, full, b, tp)
    return total


def _kda_state_bytes(cfg, elem_bytes: int, tp: int = 1) -> int:
    """One KDA layer's per-token state traffic on one of `tp` ranks: its heads' fp32 recurrent state
    [H/tp, d, d] and conv window [K-1, 3C/tp], each read and written once."""
    h, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
    return 2 * (h * d * d * 4 + (cfg.linear_conv_kernel_dim - 1) * 3 * (cfg.linear_dim // tp) * elem_bytes)


def _cache_read_bytes(cfg, elem_bytes: int, context: int) -> int:
    """Cache one query reads in an indexed layer at `context` cached rows: every pooled key (one
    index_head_dim key per complete pool), the raw (key, gate) rows of the incomplete pool, and the
    latent rows attended: the index_topk tokens of the selected pools plus the incomplete pool's
    (all of them while the context is within index_topk)."""
    P, di = cfg.index_kpool, cfg.index_head_dim
    tail = context % P
    latents = min(context, cfg.index_topk + tail)
    return ((context // P) * di + tail * 2 * di + latents * cfg.kv_lora_rank) * elem_bytes


def draft_step_bytes(cfg, elem_bytes: int, context: int, draft_vocab: int | None, tp: int) -> dict:
    weights = _active_layer_bytes(cfg, cfg.mtp_layer_index, elem_bytes, tp)
    head = head_bytes(cfg, draft_vocab or cfg.vocab_size, elem_bytes, tp)
    embed = cfg.hidden_size * elem_bytes
    cache = _cache_read_bytes(cfg, elem_bytes, context)
    return {"mtp_weights": weights, "lm_head": head, "embed_row": embed, "cache": cache,
            "total": weights + head + embed + cache}


def target_step_bytes(cfg, elem_bytes: int, context: int, tp: int) -> dict:
    layers = sum(_active_layer_bytes(cfg, i, elem_bytes, tp) for i in range(cfg.num_hidden_layers))
    top = 2 * cfg.hidden_size * elem_bytes + head_bytes(cfg, cfg.vocab_size, elem_bytes, tp)  # embedding row, norm
    kda = len(cfg.kda_layers) * _kda_state_bytes(cfg, elem_bytes, tp)
    cache = len(cfg.indexed_layers) * _cache_read_bytes(cfg, elem_bytes, context)
    return {"layer_weights": layers, "embed_norm_head": top, "kda_state": kda, "cache": cache,
            "total": layers + top + kda + cache}


def scratch_bytes(cfg, dtype: torch.dtype, context: int, gamma: int) -> int:
    """GLM-5-Next's verify, one sequence at a time, read off models/glm5_next: the larger of one
    indexed layer (gathered latent rows [L, R] and raw indexer rows, pool scores [T, index heads,
    L/P] fp32 x2, key mask [T, L] bool, attention scores [T, heads, L] fp32 x2 + probs in the model
    dtype) and one KDA layer (the replay's fp32 inputs q, k, v, g [T, C] and beta, and two copies of
    the fp32 state [H, d, d]), plus the verify's logits [T, vocab], the mHC streams [T, hc_mult, hidden]
    x4 and the gathered rows of the pooled keys."""
    d = dtype_bytes(dtype)
    t = gamma + 1
    L = context + t
    P = cfg.index_kpool
    attn = (L * cfg.kv_lora_rank * d + (P + t) * 2 * cfg.index_head_dim * d + (L // P) * cfg.index_head_dim * d
            + t * cfg.index_n_heads * (L // P + 1) * 4 * 2 + t * L
            + t * cfg.num_attention_heads * L * (4 * 2 + d))
    h, k = cfg.linear_num_heads, cfg.linear_head_dim
    kda = 4 * t * h * k * 4 + t * h * 4 + 2 * h * k * k * 4
    return max(attn, kda) + t * cfg.vocab_size * max(d, 4) + 4 * t * cfg.hc_mult * cfg.hidden_size * d


def verify_record_bytes(cfg, dtype: torch.dtype, rows: int) -> int:
    """What a verify graph of `rows` rows keeps for the KDA commit after it, per KDA layer (model
    dtype; kda.KdaRows): the extended conv window, the conv's outputs q, k, v, the forget gate's f,
    and beta's logit b, a view of the layer's joined input GEMM (kernels' path: models/fp8.join_loaded),
    whose whole output it keeps (3C + 2 head dims + H a row); and the captured commit's kept count
    (one int64 per batch row: engine/static.StaticCommit)."""
    d, h, k, c = dtype_bytes(dtype), cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_dim
    joined = 3 * c + 2 * k + h
    return 8 + len(cfg.kda_layers) * ((cfg.linear_conv_kernel_dim - 1 + rows) * 3 * c * d
                                      + rows * (3 * c + h * k + joined) * d)


TP_NOTES = [
    "state per GPU: KDA recurrent state and conv window split by heads (H/N heads per rank); the MLA latent "
    "rows and the pooled indexer rows are replicated on every rank (shared by all heads).",
    "weights/GPU: KDA q/k/v (+ convs), f_b/g_b, b_proj, dt_bias, A_log split by heads and o_proj row split; "
    "MLA q_b/kv_b split by heads, o_proj row split; routed experts E/N per rank; shared expert and "
    "dense MLP column/row split; embed_tokens/lm_head split by vocabulary; replicated: MLA q_a/kv_a, the "
    "pooled indexer, KDA f_a/g_a/o_norm, mHC, norms, routers, eh_proj.",
    "fp8 (the official FP8 checkpoint's choice, models/glm5_next/layout.fp8_quantized, as init-random --fp8 "
    "writes and the loader keeps it): trunk MLA q_a/q_b/kv_a/o and dense/shared/routed expert matrices at "
    "1 byte + fp32 scale per 128x128 block; KDA, kv_b, indexer, mHC, routers, embeddings, lm_head and the "
    "MTP block bf16.",
    "max seqs = (gpu-mem - weights/GPU) // bytes per sequence (state per GPU + the tp 1 verify scratch "
    "and CUDA-graph buffers, the KDA commit records included)."]
