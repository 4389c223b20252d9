"""Every byte formula in one place: checkpoint and in-memory weight bytes (whole, per --tp rank,
read per decode step), per-sequence state bytes, verify scratch, CUDA-graph buffers, the cache
layouts `info` compares (the byte formatter is glm5mtp_cli/units.py, free of torch for the commands).

Per-sequence state comes from the model family's `state_components(cfg, dtype)`: each component's
StateComponent.unit_bytes (a row of all its layers, or a whole recurrent slot) and bytes_for(tokens,
block_size). So a family with fixed-size recurrent slots is counted by the same code as GLM-5's
paged rows. Weight formulas read the checkpoint layout (models/glm5/layout.py) and GLM-5's
sharding rule; activation formulas (scratch, graphs) are those of the PyTorch path.
"""

from __future__ import annotations

import math

import torch

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models import family_of
from glm5mtp_cli.models.family import ROWS, SLOT
from glm5mtp_cli.models.glm5 import layout

GIB = 2**30
BF16 = 2
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes of one element of a torch dtype or a config.json dtype name (unknown names: 2)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty(0, dtype=dtype).element_size()
    return _DTYPE_BYTES.get(str(dtype).lower(), 2)


# ---- weights ------------------------------------------------------------------------------------

def tensor_bytes(family, name: str, shape: tuple[int, ...], elem_bytes: int,
                 fp8_block: tuple[int, int] | None = None, held: bool = False) -> int:
    """Bytes of one weight tensor: fp32 for the tensors the checkpoint stores in fp32 (held=False)
    or the model keeps in fp32 (held=True: routers, indexer weighting); FP8-quantized matrices at
    1 byte plus one fp32 scale per block when fp8_block is given; else `elem_bytes` each."""
    n = math.prod(shape)
    if (family.keeps_fp32(name) if held else family.stored_fp32(name)):
        return 4 * n
    if fp8_block is not None and family.is_fp8_quantized(name, shape):
        b0, b1 = fp8_block
        return n + 4 * (-(-shape[0] // b0)) * (-(-shape[1] // b1))
    return elem_bytes * n


def checkpoint_tensor_bytes(cfg, name: str, shape: tuple[int, ...]) -> int:
    """Bytes a checkpoint with cfg's dtype and quantization stores for one tensor."""
    fp8 = getattr(cfg, "fp8", False)  # only families with FP8 checkpoints have the field
    return tensor_bytes(family_of(cfg), name, shape, dtype_bytes(cfg.torch_dtype), cfg.fp8_block if fp8 else None)


def weight_bytes_per_rank(cfg, tp: int, fmt: str, with_mtp: bool = True) -> dict[str, int]:
    """Bytes of weights on one rank for a checkpoint format: 'bf16' (2 bytes each) or 'fp8' (the
    FP8 checkpoint's quantized matrices at 1 byte plus one fp32 scale per 128x128 block, the rest
    bf16; fp32 for router/bias tensors in both). Returns {'sharded': .., 'replicated': .., 'total': ..}."""
    from glm5mtp_cli.models.glm5.sharding import split_over_ranks

    family = family_of(cfg)
    out = {"sharded": 0, "replicated": 0}
    for name, shape in model_tensors(cfg, with_mtp):
        b = tensor_bytes(family, name, shape, BF16, (128, 128) if fmt == "fp8" else None, held=True)
        if split_over_ranks(name):
            out["sharded"] += -(-b // tp)
        else:
            out["replicated"] += b
    out["total"] = out["sharded"] + out["replicated"]
    return out


def model_tensors(cfg, with_mtp: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """The family's checkpoint tensors, without the MTP layer's unless with_mtp."""
    family = family_of(cfg)
    mtp = family.mtp_prefix(cfg)
    return [(n, s) for n, s in family.tensor_shapes(cfg) if with_mtp or not n.startswith(mtp)]


def param_count(cfg, with_mtp: bool = True) -> int:
    return sum(math.prod(s) for _, s in model_tensors(cfg, with_mtp))


def predicted_weight_bytes(cfg, dtype: torch.dtype, with_mtp: bool = True) -> int:
    """Parameters x the runtime dtype's size: weights are held dequantized in --dtype whatever the
    checkpoint stores."""
    return param_count(cfg, with_mtp) * dtype_bytes(dtype)


def _active_layer_bytes(cfg, layer: int | None, elem_bytes: int) -> int:
    """Bytes of one layer's weights a batch-1 token reads: every tensor, but only the chosen experts."""
    total = 0
    for name, shape in layout.tensor_shapes(cfg, layer).items():
        n = math.prod(shape)
        if ".mlp.experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += n * (4 if layout.keeps_fp32(name) else elem_bytes)
    return total


def _cache_read_bytes(cfg, layer: int, elem_bytes: int, context: int) -> int:
    """Cache bytes one query reads in a layer: every indexer key (a full layer), the selected latents."""
    keys = context * cfg.index_head_dim if cfg.has_indexer(layer) else 0
    return (keys + min(context, cfg.index_topk) * cfg.kv_cache_width) * elem_bytes


def draft_step_bytes(cfg, elem_bytes: int, context: int, draft_vocab: int | None = None) -> dict:
    """Bytes one chained draft step reads at batch 1 (the floor's numerator)."""
    weights = _active_layer_bytes(cfg, cfg.mtp_layer_index, elem_bytes)
    head = (draft_vocab or cfg.vocab_size) * cfg.hidden_size * elem_bytes
    cache = _cache_read_bytes(cfg, cfg.mtp_layer_index, elem_bytes, context)
    return {"mtp_weights": weights, "lm_head": head, "cache": cache, "total": weights + head + cache}


def target_step_bytes(cfg, elem_bytes: int, context: int) -> dict:
    """Bytes one batch-1 decode step of the (truncated) target reads: its layers' active weights,
    one embedding row, the final norm and the head, and each layer's cache reads."""
    layers = sum(_active_layer_bytes(cfg, i, elem_bytes) for i in range(cfg.num_hidden_layers))
    h = cfg.hidden_size
    top = (h + cfg.vocab_size * h) * elem_bytes + h * elem_bytes
    cache = sum(_cache_read_bytes(cfg, i, elem_bytes, context) for i in range(cfg.num_hidden_layers))
    return {"layer_weights": layers, "embed_norm_head": top, "cache": cache, "total": layers + top + cache}


# ---- per-sequence state -------------------------------------------------------------------------

def bytes_per_token(cfg, dtype: torch.dtype, with_drafter: bool = True) -> dict[str, int]:
    """State bytes per token by component (REFERENCE section 5): one row of each paged component
    over all its layers; fixed-size slots grow with no token (0). Drafter components are 0
    without a drafter."""
    return {c.name: c.unit_bytes if c.kind == ROWS and (c.owner == "target" or with_drafter) else 0
            for c in family_of(cfg).state_components(cfg, dtype, with_drafter=True)}


def state_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, with_drafter: bool = True) -> dict[str, int]:
    """Bytes one sequence holds per component when it reserves `tokens` rows (whole blocks of paged
    rows, plus each slot once); drafter components are 0 without a drafter."""
    return {c.name: c.bytes_for(tokens, block_size) if c.owner == "target" or with_drafter else 0
            for c in family_of(cfg).state_components(cfg, dtype, with_drafter=True)}


def scratch_bytes(cfg, dtype: torch.dtype, context: int, gamma: int) -> int:
    """Transient bytes of one verify forward of gamma+1 rows at `context` cached rows (the family's
    PyTorch path; see _glm5_scratch and _next_scratch)."""
    fn = _next_scratch if family_of(cfg).name == "glm5_next" else _glm5_scratch
    return fn(cfg, dtype, context, gamma)


def _next_scratch(cfg, dtype: torch.dtype, context: int, gamma: int) -> int:
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


def _glm5_scratch(cfg, dtype: torch.dtype, context: int, gamma: int) -> int:
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


def graph_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, gamma: int) -> int:
    """What a one-slot engine's CUDA graphs keep allocated between replays (graphs.EngineGraphs, one
    bucket, one gamma): the static inputs (ids, lengths, row slots, drafter hiddens), the block
    tables of each cache component (`tokens` wide: the engine's --max-seq-len; the slot's row and
    the all-scratch row) and the outputs the graphs own (the verify's logits and hiddens; the greedy
    chain's drafts). Their intermediates live in the graphs' private pool, the same peak as `scratch`."""
    if any(c.kind == SLOT for c in family_of(cfg).state_components(cfg, dtype)):
        return 0  # graph modes refuse fixed-size state (engine/graphs.py): such a family runs eagerly
    d, t = dtype_bytes(dtype), gamma + 1
    tables = 2 * 8 * math.ceil(tokens / block_size)
    verify = 8 + t * 8 + 8 + 2 * tables + t * cfg.vocab_size * d + t * cfg.hidden_size * d
    if gamma == 0:
        return verify
    draft = t * 8 + 8 + 8 + 2 * tables + t * cfg.hidden_size * d + gamma * 8
    return verify + draft


def predicted_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, gamma: int,
                    scratch_context: int) -> dict[str, int]:
    """One sequence's predicted bytes by component at `tokens` reserved rows, plus the verify scratch
    at `scratch_context` cached rows and the CUDA graphs' buffers, and their total."""
    out = state_bytes(cfg, dtype, tokens, block_size, with_drafter=gamma > 0)
    out["scratch"] = scratch_bytes(cfg, dtype, scratch_context, gamma)
    out["cuda_graphs"] = graph_bytes(cfg, dtype, tokens, block_size, gamma)
    out["total"] = sum(out.values())
    return out


def growth_bytes(cfg, dtype: torch.dtype, gamma: int, with_drafter: bool, tokens: int = 1000) -> int:
    """Bytes one sequence grows by over `tokens` more tokens: its rows and the verify scratch."""
    return (sum(bytes_per_token(cfg, dtype, with_drafter).values()) * tokens
            + scratch_bytes(cfg, dtype, tokens, gamma) - scratch_bytes(cfg, dtype, 0, gamma))


# ---- cache layouts compared by `info` (bf16 vs fp8, per layer) --------------------------------------

def cache_bytes_per_token(cfg) -> dict[str, int]:
    """Bytes per token per layer for each cache layout (REFERENCE section 5)."""
    block = 128  # one fp32 scale per 128 values in the fp8 layouts
    return {
        "mla_bf16": cfg.kv_cache_width * BF16,
        # vLLM fp8_ds_mla: latent in fp8 with fp32 scales per 128, rope part kept bf16
        "mla_fp8": cfg.kv_lora_rank + 4 * (-(-cfg.kv_lora_rank // block)) + cfg.qk_rope_head_dim * BF16,
        "indexer_bf16": cfg.index_head_dim * BF16,
        "indexer_fp8": cfg.index_head_dim + 4 * (-(-cfg.index_head_dim // block)),
    }


def cache_layers(cfg) -> dict[str, int]:
    """Layers holding each cache: every layer has MLA; only 'full' indexer layers keep index keys."""
    mtp = 1 if cfg.num_nextn_predict_layers else 0
    return {"mla_target": cfg.num_hidden_layers, "indexer_target": cfg.indexer_layers, "mla_mtp": mtp,
            "indexer_mtp": mtp}


# ---- tensor parallelism: weights, cache and concurrency per GPU --------------------------------------

def tp_table(cfg, gpu_mem: int, doc: dict, tp: int, with_mtp: bool) -> dict:
    """Weights, cache per sequence and concurrent sequences per GPU for tp in {1, 2, 4, 8, --tp} that
    divide the model, for the bf16 and the FP8 checkpoint (weights as served: FP8 stays 1 byte +
    block scales). The per-sequence cache is the same on every rank: the MLA latent is shared by
    all heads, so tensor parallelism replicates it (vLLM's MLA does the same) instead of splitting it.
    `doc` is run_profile's document (its rows alternate ceiling, budget)."""
    from glm5mtp_cli.engine.parallel import check_tp

    family = family_of(cfg)
    fp8 = any(family.is_fp8_quantized(name, shape) for name, shape in family.tensor_shapes(cfg))
    formats = ("bf16", "fp8") if fp8 else ("bf16",)  # a family without an FP8 layout has no fp8 rows
    rows = []
    for n in sorted({1, 2, 4, 8, tp}):
        try:
            check_tp(cfg, n)
        except UserError:
            continue
        for fmt in formats:
            w = weight_bytes_per_rank(cfg, n, fmt, with_mtp)
            for r_ceil, r_bud in zip(doc["rows"][0::2], doc["rows"][1::2]):
                per = {"ceiling": r_ceil["per_sequence_bytes"]["total"], "budget": r_bud["per_sequence_bytes"]["total"]}
                free = gpu_mem - w["total"]
                rows.append({"tp": n, "format": fmt, "weights_per_gpu_bytes": w["total"],
                             "sharded_per_gpu_bytes": w["sharded"], "replicated_per_gpu_bytes": w["replicated"],
                             "max_seq_len": r_ceil["max_seq_len"], "per_sequence_bytes": per,
                             "max_concurrent_sequences": {k: max(0, free // v) for k, v in per.items()}})
    return {"rows": rows, "notes": [
        "MLA latent cache (and the DSA indexer keys) are replicated on every rank, not split by heads: the latent "
        "is shared by all heads, as in vLLM's tensor parallel MLA; per-sequence cache per GPU equals the tp 1 value.",
        "weights/GPU: q_b/kv_b/o_proj split by heads, routed experts E/N per rank, shared expert and dense MLPs "
        "column/row split, embed_tokens and lm_head split by vocabulary; q_a/kv_a, norms, router, DSA indexer, "
        "eh_proj replicated. fp8: quantized matrices 1 byte + fp32 scale per 128x128 block (as served).",
        "max seqs = (gpu-mem - weights/GPU) // cache per sequence (no activation or CUDA-graph reserve)."]}
