"""Every byte formula in one place: checkpoint and in-memory weight bytes (whole, per --tp rank,
read per decode step), per-sequence state bytes, verify scratch, CUDA-graph buffers, the cache
layouts `info` compares (the byte formatter is glm5mtp_cli/units.py, free of torch for the commands).

Per-sequence state comes from the model family's `state_components(cfg, dtype, tp=...)`: each
component's StateComponent.unit_bytes (a row of all its layers, or a whole recurrent slot, per rank)
and bytes_for(tokens, block_size). So a family with fixed-size recurrent slots is counted by the
same code as GLM-5's paged rows. Weight formulas read the family's checkpoint layout and its
sharding and FP8 rules (GLM-5: models/glm5/sharding.py and layout.py; GLM-5-Next:
models/glm5_next/layout.py); the decode-step floors have one formula per component and family;
activation formulas (scratch, graphs) are those of the PyTorch path.
"""

from __future__ import annotations

import math

import torch

from glm5mtp_cli.engine.graphs import table_blocks
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models import family_of
from glm5mtp_cli.models.family import ROWS
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

def tensor_bytes(cfg, name: str, shape: tuple[int, ...], elem_bytes: int,
                 fp8_block: tuple[int, int] | None = None, held: bool = False) -> int:
    """Bytes of one weight tensor of cfg's family: fp32 for the tensors the checkpoint stores in fp32
    (held=False) or the model keeps in fp32 (held=True: routers, indexer weighting); the matrices the
    family's FP8 checkpoint quantizes (is_fp8_quantized) at 1 byte plus one fp32 scale per block when
    fp8_block is given; else `elem_bytes` each."""
    family = family_of(cfg)
    n = math.prod(shape)
    if (family.keeps_fp32(name) if held else family.stored_fp32(name)):
        return 4 * n
    if fp8_block is not None and family.is_fp8_quantized(cfg, name, shape):
        b0, b1 = fp8_block
        return n + 4 * (-(-shape[0] // b0)) * (-(-shape[1] // b1))
    return elem_bytes * n


def checkpoint_tensor_bytes(cfg, name: str, shape: tuple[int, ...]) -> int:
    """Bytes a checkpoint with cfg's dtype and quantization stores for one tensor."""
    fp8 = getattr(cfg, "fp8", False)  # only families with FP8 checkpoints have the field
    return tensor_bytes(cfg, name, shape, dtype_bytes(cfg.torch_dtype), cfg.fp8_block if fp8 else None)


def _split_rule(cfg):
    """The family's split_over_ranks(name): whether --tp splits a tensor, else every rank holds it whole."""
    if family_of(cfg).name == "glm5_next":
        from glm5mtp_cli.models.glm5_next.layout import split_over_ranks

        return split_over_ranks
    from glm5mtp_cli.models.glm5.sharding import split_over_ranks

    return split_over_ranks


def weight_bytes_per_rank(cfg, tp: int, fmt: str, with_mtp: bool = True) -> dict[str, int]:
    """Bytes of weights on one rank for a checkpoint format: 'bf16' (2 bytes each) or 'fp8' (the
    FP8 checkpoint's quantized matrices at 1 byte plus one fp32 scale per 128x128 block, the rest
    bf16); fp32 for what the model keeps in fp32 in both. A split tensor is 1/tp of its bytes per
    rank (whole experts, head groups, vocabulary rows). Returns {'sharded', 'replicated', 'total'}."""
    split = _split_rule(cfg)
    out = {"sharded": 0, "replicated": 0}
    for name, shape in model_tensors(cfg, with_mtp):
        b = tensor_bytes(cfg, name, shape, BF16, (128, 128) if fmt == "fp8" else None, held=True)
        if split(name):
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


def predicted_weight_bytes(cfg, dtype: torch.dtype, with_mtp: bool = True) -> int:
    """Bytes of the weights as loaded on one device: the runtime dtype's size each, but fp32 for the
    tensors the model keeps in fp32 (routers, indexer weighting) and, for an FP8 checkpoint, its
    quantized matrices as stored (1 byte each plus one fp32 scale per block: models/fp8.py keeps them)."""
    block = cfg.fp8_block if getattr(cfg, "fp8", False) else None
    return sum(tensor_bytes(cfg, name, shape, dtype_bytes(dtype), block, held=True)
               for name, shape in model_tensors(cfg, with_mtp))


def _rank_share(cfg, name: str, nbytes: int, tp: int) -> int:
    """One rank's bytes of a tensor's `nbytes` under --tp: 1/tp of what the family's sharding splits
    (heads, experts, MLP columns; rounded up), all of what every rank holds whole."""
    return -(-nbytes // tp) if tp > 1 and _split_rule(cfg)(name) else nbytes


def _head_bytes(cfg, rows: int, elem_bytes: int, tp: int) -> int:
    """One rank's lm_head bytes over `rows` vocabulary rows: ceil(rows/tp) rows (rank 0 holds the
    most: parallel.vocab_range)."""
    return -(-rows // tp) * cfg.hidden_size * elem_bytes


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
        total += _rank_share(cfg, name, b, tp)
    return total


def _cache_read_bytes(cfg, layer: int, elem_bytes: int, context: int) -> int:
    """Cache bytes one query reads in a layer: every indexer key (a full layer), the selected latents."""
    keys = context * cfg.index_head_dim if cfg.has_indexer(layer) else 0
    return (keys + min(context, cfg.index_topk) * cfg.kv_cache_width) * elem_bytes


def draft_step_bytes(cfg, elem_bytes: int, context: int, draft_vocab: int | None = None, tp: int = 1) -> dict:
    """Bytes one chained draft step reads at batch 1 on one of `tp` ranks (the floor's numerator):
    its share of the split weights; the MLA latent and indexer rows whole (replicated on every rank)."""
    if family_of(cfg).name == "glm5_next":
        return _next_draft_step_bytes(cfg, elem_bytes, context, draft_vocab, tp)
    weights = _active_layer_bytes(cfg, cfg.mtp_layer_index, elem_bytes, tp)
    head = _head_bytes(cfg, draft_vocab or cfg.vocab_size, elem_bytes, tp)
    cache = _cache_read_bytes(cfg, cfg.mtp_layer_index, elem_bytes, context)
    return {"mtp_weights": weights, "lm_head": head, "cache": cache, "total": weights + head + cache}


def target_step_bytes(cfg, elem_bytes: int, context: int, tp: int = 1) -> dict:
    """Bytes one batch-1 decode step of the (truncated) target reads on one of `tp` ranks: its
    layers' active weights (its share of the split ones), one embedding row, the final norm and its
    share of the head, and each layer's cache reads, whole on every rank (GLM-5-Next: and its
    share of the KDA states, read and written)."""
    if family_of(cfg).name == "glm5_next":
        return _next_target_step_bytes(cfg, elem_bytes, context, tp)
    layers = sum(_active_layer_bytes(cfg, i, elem_bytes, tp) for i in range(cfg.num_hidden_layers))
    h = cfg.hidden_size
    top = 2 * h * elem_bytes + _head_bytes(cfg, cfg.vocab_size, elem_bytes, tp)
    cache = sum(_cache_read_bytes(cfg, i, elem_bytes, context) for i in range(cfg.num_hidden_layers))
    return {"layer_weights": layers, "embed_norm_head": top, "cache": cache, "total": layers + top + cache}


# GLM-5-Next's floors, one formula per component: a layer's active weights, a KDA layer's state, an
# indexed layer's cache reads.

def _next_active_layer_bytes(cfg, layer: int, elem_bytes: int, tp: int = 1) -> int:
    """Weights of trunk layer `layer` (or the MTP layer) one batch-1 token reads on one of `tp` ranks:
    every tensor (mHC, KDA or MLA with its indexer, router, shared expert, dense MLP; this rank's
    slice of a split one), of the routed experts only the top-k chosen (top-k/tp a rank on average); fp32 for what the model keeps in fp32; an FP8 checkpoint's quantized matrices at
    1 byte plus their block scales (as loaded, models/fp8.py)."""
    from glm5mtp_cli.models.glm5_next import layout as next_layout

    shapes = next_layout.mtp_shapes(cfg) if layer == cfg.mtp_layer_index else next_layout.layer_shapes(cfg, layer)
    block = cfg.fp8_block if cfg.fp8 else None
    total = 0
    for name, shape in shapes.items():
        full = next_layout.layer_prefix(layer) + name
        b = tensor_bytes(cfg, full, shape, elem_bytes, block, held=True)
        if name.startswith("mlp.experts."):
            b = b * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += _rank_share(cfg, full, b, tp)
    return total


def _next_kda_state_bytes(cfg, elem_bytes: int, tp: int = 1) -> int:
    """One KDA layer's per-token state traffic on one of `tp` ranks: its heads' fp32 recurrent state
    [H/tp, d, d] and conv window [K-1, 3C/tp], each read and written once."""
    h, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
    return 2 * (h * d * d * 4 + (cfg.linear_conv_kernel_dim - 1) * 3 * (cfg.linear_dim // tp) * elem_bytes)


def _next_cache_read_bytes(cfg, elem_bytes: int, context: int) -> int:
    """Cache one query reads in an indexed layer at `context` cached rows: every pooled key (one
    index_head_dim key per complete pool), the raw (key, gate) rows of the incomplete pool, and the
    latent rows attended: the index_topk tokens of the selected pools plus the incomplete pool's
    (all of them while the context is within index_topk)."""
    P, di = cfg.index_kpool, cfg.index_head_dim
    tail = context % P
    latents = min(context, cfg.index_topk + tail)
    return ((context // P) * di + tail * 2 * di + latents * cfg.kv_lora_rank) * elem_bytes


def _next_draft_step_bytes(cfg, elem_bytes: int, context: int, draft_vocab: int | None, tp: int) -> dict:
    weights = _next_active_layer_bytes(cfg, cfg.mtp_layer_index, elem_bytes, tp)
    head = _head_bytes(cfg, draft_vocab or cfg.vocab_size, elem_bytes, tp)
    embed = cfg.hidden_size * elem_bytes
    cache = _next_cache_read_bytes(cfg, elem_bytes, context)
    return {"mtp_weights": weights, "lm_head": head, "embed_row": embed, "cache": cache,
            "total": weights + head + embed + cache}


def _next_target_step_bytes(cfg, elem_bytes: int, context: int, tp: int) -> dict:
    layers = sum(_next_active_layer_bytes(cfg, i, elem_bytes, tp) for i in range(cfg.num_hidden_layers))
    top = 2 * cfg.hidden_size * elem_bytes + _head_bytes(cfg, cfg.vocab_size, elem_bytes, tp)  # embedding row, norm
    kda = len(cfg.kda_layers) * _next_kda_state_bytes(cfg, elem_bytes, tp)
    cache = len(cfg.indexed_layers) * _next_cache_read_bytes(cfg, elem_bytes, context)
    return {"layer_weights": layers, "embed_norm_head": top, "kda_state": kda, "cache": cache,
            "total": layers + top + kda + cache}


# ---- per-sequence state -------------------------------------------------------------------------

def bytes_per_token(cfg, dtype: torch.dtype, with_drafter: bool = True) -> dict[str, int]:
    """State bytes per token by component (REFERENCE section 5): one row of each paged component
    over all its layers; fixed-size slots grow with no token (0). Drafter components are 0
    without a drafter."""
    return {c.name: c.unit_bytes if c.kind == ROWS and (c.owner == "target" or with_drafter) else 0
            for c in family_of(cfg).state_components(cfg, dtype, with_drafter=True)}


def state_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, with_drafter: bool = True,
                tp: int = 1) -> dict[str, int]:
    """Bytes one sequence holds per component on one of `tp` ranks when it reserves `tokens` rows
    (whole blocks of paged rows, plus each slot once); drafter components are 0 without a drafter."""
    return {c.name: c.bytes_for(tokens, block_size) if c.owner == "target" or with_drafter else 0
            for c in family_of(cfg).state_components(cfg, dtype, with_drafter=True, tp=tp)}


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


def graph_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, gamma: int, max_seq_len: int) -> int:
    """What a one-slot engine's CUDA graphs keep allocated between replays (graphs.EngineGraphs, one
    bucket, one gamma) for a sequence of `tokens` reserved rows: the static inputs (ids, lengths, row
    slots, drafter hiddens), the block tables of each row component (table_blocks wide, 8 bytes a
    block; the slot's row and the all-scratch row), the slot indices of each slot component (the
    same two entries) and the outputs the graphs own (the verify's logits and hiddens, GLM-5-Next's
    KDA commit records; the greedy chain's drafts). Their intermediates live in the graphs' private
    pool, the same peak as `scratch`."""
    d, t = dtype_bytes(dtype), gamma + 1
    tables = 2 * 8 * table_blocks(tokens, block_size, max_seq_len)
    comps = family_of(cfg).state_components(cfg, dtype)

    def indices(owner: str) -> int:
        return sum(tables if c.kind == ROWS else 2 * 8 for c in comps if c.owner == owner)

    verify = 8 + t * 8 + 8 + indices("target") + t * cfg.vocab_size * d + t * cfg.hidden_size * d
    if family_of(cfg).name == "glm5_next":
        # per KDA layer: the extended conv window (model dtype) and the fp32 kernel inputs q, k, v, g, beta
        h = cfg.linear_num_heads
        verify += len(cfg.kda_layers) * ((cfg.linear_conv_kernel_dim - 1 + t) * 3 * cfg.linear_dim * d
                                         + t * h * (4 * cfg.linear_head_dim + 1) * 4)
    if gamma == 0:
        return verify
    draft = t * 8 + 8 + 8 + indices("drafter") + t * cfg.hidden_size * d + gamma * 8
    return verify + draft


def predicted_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, gamma: int,
                    scratch_context: int, max_seq_len: int, tp: int = 1) -> dict[str, int]:
    """One sequence's predicted bytes by component at `tokens` reserved rows (on one of `tp` ranks),
    plus the verify scratch at `scratch_context` cached rows and the CUDA graphs' buffers (under
    --max-seq-len max_seq_len), and their total."""
    out = state_bytes(cfg, dtype, tokens, block_size, with_drafter=gamma > 0, tp=tp)
    out["scratch"] = scratch_bytes(cfg, dtype, scratch_context, gamma)
    out["cuda_graphs"] = graph_bytes(cfg, dtype, tokens, block_size, gamma, max_seq_len)
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

def tp_table(cfg, gpu_mem: int, doc: dict, tp: int, with_mtp: bool, dtype: torch.dtype) -> dict:
    """Weights, bytes per sequence and concurrent sequences per GPU for tp in {1, 2, 4, 8, --tp}
    that the family's sharding rules divide, for the bf16 and the FP8 checkpoint (weights as served:
    FP8 stays 1 byte + block scales). A sequence's state on one rank is the family's
    state_components at that tp (pools of the same sizes as the engine's); its verify scratch and
    graph buffers are the tp 1 values (an upper bound: attention heads split too).
    `doc` is run_profile's document (its rows alternate ceiling, budget)."""
    family = family_of(cfg)
    has_fp8 = any(family.is_fp8_quantized(cfg, name, shape) for name, shape in family.tensor_shapes(cfg))
    formats = ("bf16", "fp8") if has_fp8 else ("bf16",)  # a family without an FP8 layout has no fp8 rows
    rows = []
    from glm5mtp_cli.engine.parallel import check_tp

    for n in sorted({1, 2, 4, 8, tp}):
        try:
            check_tp(cfg, n)
        except UserError:
            continue
        for fmt in formats:
            w = weight_bytes_per_rank(cfg, n, fmt, with_mtp)
            for r_ceil, r_bud in zip(doc["rows"][0::2], doc["rows"][1::2]):
                state, transient, per = {}, {}, {}
                for policy, r in (("ceiling", r_ceil), ("budget", r_bud)):
                    st = state_bytes(cfg, dtype, r["reserved_tokens"], doc["block_size"], with_mtp, tp=n)
                    state[policy] = sum(st.values())
                    transient[policy] = r["per_sequence_bytes"]["scratch"] + r["per_sequence_bytes"]["cuda_graphs"]
                    per[policy] = state[policy] + transient[policy]
                free = gpu_mem - w["total"]
                rows.append({"tp": n, "format": fmt, "weights_per_gpu_bytes": w["total"],
                             "sharded_per_gpu_bytes": w["sharded"], "replicated_per_gpu_bytes": w["replicated"],
                             "max_seq_len": r_ceil["max_seq_len"], "state_per_sequence_bytes": state,
                             "scratch_graphs_per_sequence_bytes": transient, "per_sequence_bytes": per,
                             "max_concurrent_sequences": {k: max(0, free // v) for k, v in per.items()}})
    return {"rows": rows, "notes": _TP_NOTES[family.name]}


_TP_NOTES = {
    "glm5": [
        "MLA latent cache (and the DSA indexer keys) are replicated on every rank, not split by heads: the latent "
        "is shared by all heads, as in vLLM's tensor parallel MLA; per-sequence cache per GPU equals the tp 1 value.",
        "weights/GPU: q_b/kv_b/o_proj split by heads, routed experts E/N per rank, shared expert and dense MLPs "
        "column/row split, embed_tokens and lm_head split by vocabulary; q_a/kv_a, norms, router, DSA indexer, "
        "eh_proj replicated. fp8: quantized matrices 1 byte + fp32 scale per 128x128 block (as served).",
        "max seqs = (gpu-mem - weights/GPU) // bytes per sequence (cache + one verify's scratch + CUDA-graph "
        "buffers; no other reserve)."],
    "glm5_next": [
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
        "and CUDA-graph buffers, the KDA commit records included)."],
}
