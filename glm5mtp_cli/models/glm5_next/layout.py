"""Checkpoint tensor names and shapes of a GLM-5-Next model in the REAL layout, and their mapping to
this package's module parameters.

Real checkpoints (and `Glm5NextForConditionalGeneration.save_pretrained`) write the text tower under
`model.language_model.` (layers, embed_tokens, norm), `lm_head.weight` at the top level, the vision
tower under `model.visual.` (never read here) and the MTP layer as `layers.{num_hidden_layers}`.
The modules in this package name their parameters exactly as the checkpoint does after the prefix
(separate q/k/v conv weights, per-expert tensors, `hc_attn_fn`, ...), so the mapping is a prefix
strip: no renames to keep in step with transformers' conversion table.
"""

from __future__ import annotations

import re

from glm5mtp_cli.models.glm5 import layout as glm5_layout
from glm5mtp_cli.models.glm5_next.config import NextConfig

PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
VISUAL_PREFIX = "model.visual."


def layer_prefix(layer: int) -> str:
    return f"{PREFIX}layers.{layer}."


def is_visual(name: str) -> bool:
    return name.startswith(VISUAL_PREFIX)


def _mla_shapes(cfg: NextConfig) -> dict[str, tuple[int, ...]]:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    di, hi = cfg.index_head_dim, cfg.index_n_heads
    return {
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, d),
        "self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
        "self_attn.q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank, d),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (d, h * cfg.v_head_dim),
        "self_attn.indexer.wq_b.weight": (hi * di, cfg.q_lora_rank),
        "self_attn.indexer.wk.weight": (di, d),
        "self_attn.indexer.k_norm.weight": (di,),
        "self_attn.indexer.k_norm.bias": (di,),
        "self_attn.indexer.weights_proj.weight": (hi, d),
        "self_attn.indexer.index_kpool_compress_ape": (cfg.index_kpool, di),
        "self_attn.indexer.index_kpool_compress_gate": (di, d),
    }


def _kda_shapes(cfg: NextConfig) -> dict[str, tuple[int, ...]]:
    d, c, hd, nh, k = cfg.hidden_size, cfg.linear_dim, cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim
    out = {f"self_attn.{x}_proj.weight": (c, d) for x in "qkv"}
    out.update({f"self_attn.{x}_conv1d.weight": (c, 1, k) for x in "qkv"})
    out.update({
        "self_attn.f_a_proj.weight": (hd, d), "self_attn.f_b_proj.weight": (c, hd),
        "self_attn.dt_bias": (c,), "self_attn.A_log": (nh,), "self_attn.b_proj.weight": (nh, d),
        "self_attn.g_a_proj.weight": (hd, d), "self_attn.g_b_proj.weight": (c, hd),
        "self_attn.o_norm.weight": (hd,), "self_attn.o_proj.weight": (d, c),
    })
    return out


def _mlp_shapes(cfg: NextConfig, moe: bool) -> dict[str, tuple[int, ...]]:
    d = cfg.hidden_size
    if not moe:
        i = cfg.intermediate_size
        return {"mlp.gate_proj.weight": (i, d), "mlp.up_proj.weight": (i, d), "mlp.down_proj.weight": (d, i)}
    i, e, si = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.moe_intermediate_size * cfg.n_shared_experts
    out = {"mlp.gate.weight": (e, d), "mlp.gate.e_score_correction_bias": (e,)}
    for x in range(e):
        out.update({f"mlp.experts.{x}.gate_proj.weight": (i, d), f"mlp.experts.{x}.up_proj.weight": (i, d),
                    f"mlp.experts.{x}.down_proj.weight": (d, i)})
    if cfg.n_shared_experts:
        out.update({"mlp.shared_experts.gate_proj.weight": (si, d), "mlp.shared_experts.up_proj.weight": (si, d),
                    "mlp.shared_experts.down_proj.weight": (d, si)})
    return out


def layer_shapes(cfg: NextConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Tensors of trunk layer `layer` (0..num_hidden_layers-1), names relative to its prefix."""
    d, n = cfg.hidden_size, cfg.hc_mult
    out = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    for site in ("attn", "ffn"):  # mHC: (2 + n) * n mixing weights from the n*d flattened streams
        out.update({f"hc_{site}_fn": ((2 + n) * n, n * d), f"hc_{site}_base": ((2 + n) * n,), f"hc_{site}_scale": (3,)})
    out.update(_kda_shapes(cfg) if cfg.is_kda(layer) else _mla_shapes(cfg))
    out.update(_mlp_shapes(cfg, cfg.is_moe(layer)))
    return out


def mtp_shapes(cfg: NextConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layer's tensors, relative to `layers.{num_hidden_layers}.`: a plain-residual MLA +
    own indexer + MoE block (no hc_*), its input projection and norms; no embed/head of its own."""
    d = cfg.hidden_size
    out = {"eh_proj.weight": (d, 2 * d), "enorm.weight": (d,), "hnorm.weight": (d,), "shared_head.norm.weight": (d,),
           "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    out.update(_mla_shapes(cfg))
    out.update(_mlp_shapes(cfg, True))
    return out


def target_shapes(cfg: NextConfig) -> dict[str, tuple[int, ...]]:
    """Full checkpoint names -> shapes of the target (trunk, embedding, final norm, lm_head)."""
    out = {PREFIX + "embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), PREFIX + "norm.weight": (cfg.hidden_size,),
           LM_HEAD: (cfg.vocab_size, cfg.hidden_size)}
    for layer in range(cfg.num_hidden_layers):
        out.update({layer_prefix(layer) + k: v for k, v in layer_shapes(cfg, layer).items()})
    return out


def checkpoint_shapes(cfg: NextConfig) -> dict[str, tuple[int, ...]]:
    """Every text tensor a checkpoint holds (target + MTP layer)."""
    out = target_shapes(cfg)
    out.update({layer_prefix(cfg.mtp_layer_index) + k: v for k, v in mtp_shapes(cfg).items()})
    return out


# Tensors computed in fp32 whatever the load dtype (REFERENCE section 10): KDA gate parameters and
# conv weights, mHC mixing weights, the router and its bias.
_FP32_SUFFIXES = ("self_attn.A_log", "self_attn.dt_bias", "_conv1d.weight", "mlp.gate.weight",
                  "mlp.gate.e_score_correction_bias", "self_attn.o_norm.weight")


def keeps_fp32(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return key.endswith(_FP32_SUFFIXES) or last.startswith("hc_")


# What `info` counts each tensor under (the order its table lists them).
COMPONENTS = ("embeddings", "KDA (linear attention)", "attention (MLA)", "indexer (DSA)", "mHC", "routed experts",
              "shared experts", "dense MLPs", "router", "norms", "MTP eh_proj", "head")
_LAYER_NO = re.compile(r"layers\.(\d+)\.")


def component_of(cfg: NextConfig, name: str) -> str:
    """GLM-5's components (same tensor suffixes), plus KDA attention and the mHC weights."""
    if ".self_attn." in name and ".self_attn.indexer." not in name:
        m = _LAYER_NO.search(name)
        if m and cfg.is_kda(int(m.group(1))):
            return "KDA (linear attention)"
    if name.rsplit(".", 1)[-1].startswith("hc_"):
        return "mHC"
    return glm5_layout.component_of(name)


def stored_fp32(name: str) -> bool:
    """Tensors the published checkpoint stores in fp32 (REFERENCE-glm5next section 2 and trap 15)."""
    last = name.rsplit(".", 1)[-1]
    return last in ("A_log", "dt_bias", "e_score_correction_bias") or (last.startswith("hc_") and not last.endswith("_fn"))


# ---- the deployed form, as predicted from the config (diagnostics/sizing.py) ----------------------

# KDA tensors split by heads over ranks (each rank runs H/N heads: their q/k/v rows and convs, gate
# rows, beta rows, decay parameters); f_a/g_a (shared low-rank inputs) and o_norm (one per head
# dim, shared by all heads) stay whole.
_KDA_HEAD_SPLIT = tuple(f"self_attn.{x}" for x in (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_b_proj.weight", "g_b_proj.weight", "b_proj.weight", "dt_bias", "A_log"))
_HEAD_SPLIT = _KDA_HEAD_SPLIT + ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")
# What the official FP8 checkpoint quantizes (e4m3 + fp32 `weight_scale_inv` per 128x128 block,
# REFERENCE-glm5next section 2): the MLA projections but kv_b, and every MLP matrix but the router.
_FP8_MLA = tuple(f"self_attn.{x}.weight" for x in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"))


def split_over_ranks(name: str) -> bool:
    """Whether tensor parallelism splits `name` over ranks, else every rank holds it whole. Split:
    KDA heads and MLA heads (q_b/kv_b) with both o_proj (row parallel), routed experts (E/N whole
    experts per rank), shared expert and dense MLP (column/row), embed_tokens and lm_head (vocabulary).
    Whole: MLA q_a/kv_a, the pooled indexer, KDA f_a/g_a/o_norm, mHC, norms, routers, eh_proj."""
    if name.endswith(("embed_tokens.weight", LM_HEAD)):
        return True
    if name.endswith(_HEAD_SPLIT):
        return True
    return ".mlp." in name and ".mlp.gate." not in name


def fp8_quantized(cfg: NextConfig, name: str) -> bool:
    """Whether the official FP8 checkpoint stores `name` as float8_e4m3fn with a 128x128-block
    `weight_scale_inv` (what init-random --fp8 and quantize write, and sizing predicts): MLA q_a/q_b/
    kv_a/o of the indexed trunk layers and the gate/up/down matrices of dense MLPs, routed and shared
    experts of the trunk. bf16: every KDA tensor (its o_proj too), kv_b, the indexer, mHC, routers,
    embed_tokens, lm_head and the whole MTP (nextn) block (REFERENCE-glm5next sections 2 and 9).
    A loaded checkpoint's own choice is what its files say (models/fp8.convert), not this rule."""
    m = _LAYER_NO.search(name)
    if m is None or int(m.group(1)) >= cfg.num_hidden_layers:
        return False
    if ".mlp." in name:
        return name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
    return name.endswith(_FP8_MLA) and not cfg.is_kda(int(m.group(1)))
