"""Checkpoint tensor names and shapes computed from a ModelConfig alone.

One source of truth for `info` (parameter and byte counts), `init-random` (what to generate) and
the tests (what a written checkpoint must hold), so those can never disagree about a name or a shape.
Names are the Hugging Face checkpoint names; the MTP block is `model.layers.{num_hidden_layers}`.
"""

from __future__ import annotations

from typing import Iterator

from glm5mtp_cli.models.glm5.config import ModelConfig

Shape = tuple[int, ...]

# Tensors the published FP8 checkpoint leaves unquantized (REFERENCE section 1), matched by suffix.
_FP8_EXCLUDED_SUFFIXES = (
    "layernorm.weight", "mlp.gate.weight", "e_score_correction_bias", "indexer.k_norm.weight",
    "indexer.k_norm.bias", "indexer.weights_proj.weight", "eh_proj.weight", "enorm.weight",
    "hnorm.weight", "shared_head.norm.weight", "embed_tokens.weight", "lm_head.weight", "model.norm.weight",
)

# Tensors the model keeps in fp32 whatever its dtype: routing and indexer weighting are precision
# sensitive (a bf16 router flips expert choices between runs with different batch shapes).
_FP32_SUFFIXES = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")


def keeps_fp32(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def is_fp8_quantized(name: str, shape: Shape) -> bool:
    """Whether an FP8 checkpoint stores `name` as float8_e4m3fn with a `_scale_inv` companion."""
    return len(shape) == 2 and name.endswith(".weight") and not name.endswith(_FP8_EXCLUDED_SUFFIXES)


def stored_fp32(name: str) -> bool:
    """Whether the checkpoint itself stores `name` in fp32 (the published one does for the bias)."""
    return name.endswith("e_score_correction_bias")


def _attention(cfg: ModelConfig, p: str, indexer: bool) -> dict[str, Shape]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    a = p + "self_attn."
    s: dict[str, Shape] = {
        a + "q_a_proj.weight": (cfg.q_lora_rank, h),
        a + "q_a_layernorm.weight": (cfg.q_lora_rank,),
        a + "q_b_proj.weight": (heads * cfg.qk_head_dim, cfg.q_lora_rank),
        a + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        a + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        a + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        a + "o_proj.weight": (h, heads * cfg.v_head_dim),
    }
    if indexer:
        i = a + "indexer."
        s[i + "wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        s[i + "wk.weight"] = (cfg.index_head_dim, h)
        s[i + "k_norm.weight"] = (cfg.index_head_dim,)
        s[i + "k_norm.bias"] = (cfg.index_head_dim,)
        s[i + "weights_proj.weight"] = (cfg.index_n_heads, h)
    return s


def _mlp(cfg: ModelConfig, p: str, moe: bool) -> dict[str, Shape]:
    h = cfg.hidden_size
    m = p + "mlp."

    def ffn(prefix: str, inter: int) -> dict[str, Shape]:
        return {prefix + "gate_proj.weight": (inter, h), prefix + "up_proj.weight": (inter, h),
                prefix + "down_proj.weight": (h, inter)}

    if not moe:
        return ffn(m, cfg.intermediate_size)
    s: dict[str, Shape] = {m + "gate.weight": (cfg.n_routed_experts, h),
                           m + "gate.e_score_correction_bias": (cfg.n_routed_experts,)}
    for e in range(cfg.n_routed_experts):
        s.update(ffn(f"{m}experts.{e}.", cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        s.update(ffn(m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts))
    return s


def tensor_shapes(cfg: ModelConfig, layer: int | None) -> dict[str, Shape]:
    """Checkpoint name -> shape for one layer.

    layer None: the top-level tensors (embeddings, final norm, head). 0 <= layer < L: decoder layer
    `layer`. layer == L (cfg.mtp_layer_index): the MTP block, a full MoE decoder layer with its own
    indexer plus eh_proj/enorm/hnorm/shared_head.norm (no embed_tokens, no shared_head.head).
    """
    h = cfg.hidden_size
    if layer is None:
        return {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
                "lm_head.weight": (cfg.vocab_size, h)}
    if not 0 <= layer <= cfg.num_hidden_layers:
        raise ValueError(f"layer {layer} outside 0..{cfg.num_hidden_layers}")
    p = f"model.layers.{layer}."
    s: dict[str, Shape] = {}
    if layer == cfg.mtp_layer_index:
        s.update({p + "eh_proj.weight": (h, 2 * h), p + "enorm.weight": (h,), p + "hnorm.weight": (h,),
                  p + "shared_head.norm.weight": (h,)})
    s[p + "input_layernorm.weight"] = (h,)
    s.update(_attention(cfg, p, cfg.has_indexer(layer)))
    s[p + "post_attention_layernorm.weight"] = (h,)
    s.update(_mlp(cfg, p, cfg.is_moe_layer(layer)))
    return s


def layer_order(cfg: ModelConfig, mtp: bool = True) -> list[int | None]:
    """The layers in checkpoint order: top-level first, decoder layers, then the MTP block."""
    order: list[int | None] = [None, *range(cfg.num_hidden_layers)]
    if mtp and cfg.num_nextn_predict_layers:
        order.append(cfg.mtp_layer_index)
    return order


def all_tensor_shapes(cfg: ModelConfig, mtp: bool = True) -> Iterator[tuple[str, Shape]]:
    for layer in layer_order(cfg, mtp):
        yield from tensor_shapes(cfg, layer).items()


def component_of(name: str) -> str:
    """The component a tensor's parameters are counted under in `info`."""
    if name.endswith("embed_tokens.weight"):
        return "embeddings"
    if name == "lm_head.weight" or name.endswith("shared_head.head.weight"):
        return "head"
    if ".indexer." in name:
        return "indexer (DSA)"
    if ".self_attn." in name:
        return "attention (MLA)"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".mlp.shared_experts." in name:
        return "shared experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense MLPs"
    if name.endswith("eh_proj.weight"):
        return "MTP eh_proj"
    return "norms"


COMPONENTS = ("embeddings", "attention (MLA)", "indexer (DSA)", "routed experts", "shared experts",
              "dense MLPs", "router", "norms", "MTP eh_proj", "head")


# ---- which tensors a rank holds a slice of (weight bytes per rank) ---------------------------------

def split_over_ranks(name: str) -> bool:
    """Whether a checkpoint tensor is split over ranks (else replicated on every rank): the
    rules sharding.py applies."""
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return True
    if ".indexer." in name:
        return False
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")):
        return True
    return ".mlp." in name and ".mlp.gate." not in name  # experts, shared experts, dense MLPs
