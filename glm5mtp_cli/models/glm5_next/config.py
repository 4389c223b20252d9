"""NextConfig: the GLM-5-Next (`glm5_next`, GLM-5.3-Flash) text configuration from a config.json.

Accepts the published nested layout (`model_type: glm5_next` with a `text_config` of model_type
`glm5_next_text`) and a flat one (text fields at the top level). Spellings that real checkpoints use
are normalised here so nothing downstream sees them: `deepseek_sparse_attention`/`full_attention`
layer types mean an indexed (MLA + pooled DSA) layer, and the KDA sizes live in `linear_attn_config`.

`index_kpool` is required from the file: transformers silently defaults it to 16 while the
published checkpoints use 4, and a wrong pool size changes pooling and the tail width without any
error (REFERENCE-glm5next section 13, trap 1).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models.glm5.config import check_quantization, fp8_block, is_fp8

MODEL_TYPES = ("glm5_next", "glm5_next_text")
KDA = "linear_attention"
INDEXED = "indexed_attention"
# Checkpoint / older spellings of an indexed (MLA + DSA indexer) layer.
_INDEXED_ALIASES = ("indexed_attention", "deepseek_sparse_attention", "full_attention")


class NextConfigError(UserError, ValueError):
    """A config.json that cannot describe a GLM-5-Next model."""


_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_topk",
    "index_kpool",
)


@dataclass
class NextConfig:
    model_type = "glm5_next"  # a class attribute, not a field: the family this config belongs to

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    layer_types: list[str]
    mlp_layer_types: list[str]
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float = -5.0
    qk_rope_head_dim: int = 0
    num_key_value_heads: int | None = None
    index_kpool_always_select_tail: bool = True
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 1
    # Chained MTP draft steps reuse draft step 0's own pool top-k instead of scoring again
    # (PooledMtp, MlaLayer.forward). Not read by transformers; GLM-5.3-Flash's config says true
    # (REFERENCE-glm5next sections 1 and 9). Either way only the drafts move, never the output.
    index_share_for_mtp_iteration: bool = True
    # GLM-5-Next-FP8: block-scaled e4m3 matrices (which ones: layout.fp8_quantized), as GLM-5-FP8's
    quantization_config: dict | None = None
    torch_dtype: str = "bfloat16"
    source: str = "<dict>"

    # ---- derived ------------------------------------------------------------------------------
    @property
    def mtp_layer_index(self) -> int:
        """The MTP layer is stored as `model.language_model.layers.{num_hidden_layers}`."""
        return self.num_hidden_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def fp8(self) -> bool:
        return is_fp8(self.quantization_config)

    @property
    def fp8_block(self) -> tuple[int, int]:
        return fp8_block(self.quantization_config)

    @property
    def linear_dim(self) -> int:
        """Channels of one of q/k/v in a KDA layer (heads x head dim)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def indexed_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == INDEXED]

    def is_kda(self, layer: int) -> bool:
        return layer < self.num_hidden_layers and self.layer_types[layer] == KDA

    def is_moe(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:  # the MTP layer: a MoE block (REFERENCE section 9)
            return True
        return self.mlp_layer_types[layer] == "sparse"

    def with_layers(self, num_layers: int) -> "NextConfig":
        """A depth-truncated copy (the first `num_layers` trunk layers; the MTP layer stays)."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise NextConfigError(f"{self.source}: --layers must be in 1..{self.num_hidden_layers}, got {num_layers}")
        return dataclasses.replace(self, num_hidden_layers=num_layers, layer_types=list(self.layer_types[:num_layers]),
                                   mlp_layer_types=list(self.mlp_layer_types[:num_layers]))

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the published nested layout (what init-random writes); from_dict reads it back."""
        text: dict[str, Any] = {"model_type": "glm5_next_text"}
        for f in dataclasses.fields(self):
            if f.name in ("source", "layer_types", "torch_dtype", "quantization_config") or f.name.startswith("linear_"):
                continue
            text[f.name] = getattr(self, f.name)
        text["layer_types"] = ["linear_attention" if t == KDA else "deepseek_sparse_attention" for t in self.layer_types]
        text["linear_attn_config"] = {"num_heads": self.linear_num_heads, "head_dim": self.linear_head_dim,
                                      "short_conv_kernel_size": self.linear_conv_kernel_dim,
                                      "gate_lower_bound": self.linear_lower_bound}
        text["dtype"] = self.torch_dtype
        out = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
               "text_config": text, "dtype": self.torch_dtype}
        if self.quantization_config:  # top level, as transformers writes a composite model's
            out["quantization_config"] = self.quantization_config
        return out

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "NextConfig":
        if not isinstance(raw, dict):
            raise NextConfigError(f"{source}: not a JSON object")
        top_type = raw.get("model_type")
        if top_type not in MODEL_TYPES:
            raise NextConfigError(f"{source}: field 'model_type' is {top_type!r}; expected one of {', '.join(MODEL_TYPES)}")
        text = raw.get("text_config")
        if text is not None:  # nested: the text fields live under text_config
            if not isinstance(text, dict):
                raise NextConfigError(f"{source}: field 'text_config' must be an object")
            if text.get("model_type", "glm5_next_text") != "glm5_next_text":
                raise NextConfigError(f"{source}: text_config.model_type is {text.get('model_type')!r}, expected 'glm5_next_text'")
            merged = dict(text)
            for k in ("eos_token_id", "pad_token_id", "torch_dtype", "dtype", "tie_word_embeddings", "quantization_config"):
                if k not in merged and k in raw:
                    merged[k] = raw[k]
            text, where = merged, f"{source} (text_config)"
        else:
            text, where = raw, source

        def err(name: str, msg: str) -> NextConfigError:
            return NextConfigError(f"{where}: field '{name}' {msg}")

        for name in _REQUIRED:
            if text.get(name) is None:
                why = " (transformers would silently use 16; GLM-5.3-Flash uses 4)" if name == "index_kpool" else ""
                raise err(name, "is missing" + why)
        kw: dict[str, Any] = {}
        skip = {"source", "layer_types", "mlp_layer_types", "eos_token_id", "linear_num_heads", "linear_head_dim",
                "linear_conv_kernel_dim", "linear_lower_bound"}
        for f in dataclasses.fields(cls):
            if f.name not in skip and text.get(f.name) is not None:
                kw[f.name] = text[f.name]
        if "torch_dtype" not in kw and isinstance(text.get("dtype"), str):
            kw["torch_dtype"] = text["dtype"]
        kw["eos_token_id"] = _id_list(text.get("eos_token_id"), err)
        kw.update(_linear(text, err))
        n = text["num_hidden_layers"]
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise err("num_hidden_layers", f"must be a positive integer, got {n!r}")
        kw["layer_types"] = _layer_types(text.get("layer_types"), n, err)
        kw["mlp_layer_types"] = _mlp_types(text.get("mlp_layer_types"), n, err)
        _check_indexer_types(text, n, err)
        cfg = cls(source=source, **kw)
        cfg._check(err)
        return cfg

    def _check(self, err) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                raise err(f.name, f"must be an integer, got {v!r}")
            if f.type == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                raise err(f.name, f"must be a number, got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):
                raise err(f.name, f"must be true or false, got {v!r}")
        for name in _REQUIRED + ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hc_mult",
                                 "hc_sinkhorn_iters", "n_group", "topk_group"):
            if getattr(self, name) <= 0:
                raise err(name, f"must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads != self.num_attention_heads:
            raise err("num_key_value_heads", "must equal num_attention_heads for MLA")
        if self.qk_rope_head_dim != 0:
            raise err("qk_rope_head_dim", f"must be 0: GLM-5-Next attention is NoPE, got {self.qk_rope_head_dim}")
        if self.index_topk % self.index_kpool:
            raise err("index_topk", f"({self.index_topk}) must be divisible by index_kpool ({self.index_kpool})")
        if self.n_group != 1 or self.topk_group != 1:
            raise err("n_group", "must be 1 (with topk_group 1): group-limited routing is not used by GLM-5-Next")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise err("num_experts_per_tok", "exceeds n_routed_experts")
        if self.num_nextn_predict_layers > 1:
            raise err("num_nextn_predict_layers", "above 1 is not supported (one MTP layer)")
        check_quantization(self.quantization_config, err)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "NextConfig":
        from glm5mtp_cli.core.families import read_config_file

        return cls.from_dict(read_config_file(path, NextConfigError), source=str(path))


def _id_list(v: Any, err) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    raise err("eos_token_id", "must be an integer or a list of integers")


def _linear(text: dict, err) -> dict[str, Any]:
    """KDA sizes: `linear_attn_config` {num_heads, head_dim, short_conv_kernel_size, gate_lower_bound}
    wins over top-level `linear_*` fields (its `kda_layers`/`full_attn_layers` are ignored: layer_types rules)."""
    lac = text.get("linear_attn_config")
    if lac is not None and not isinstance(lac, dict):
        raise err("linear_attn_config", "must be an object")
    lac = lac or {}
    out = {
        "linear_num_heads": lac.get("num_heads", text.get("linear_num_heads")),
        "linear_head_dim": lac.get("head_dim", text.get("linear_head_dim")),
        "linear_conv_kernel_dim": lac.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
        "linear_lower_bound": lac.get("gate_lower_bound", text.get("linear_lower_bound", -5.0)),
    }
    for k in ("linear_num_heads", "linear_head_dim"):
        if out[k] is None:
            raise err("linear_attn_config", f"has no {k.removeprefix('linear_')} (nor is '{k}' given)")
    if out["linear_lower_bound"] is None:
        if lac.get("safe_gate", True) is False:
            raise err("linear_attn_config", "without a gate lower bound (softplus forget gate) is not supported")
        out["linear_lower_bound"] = -5.0  # safe_gate's bound, as the published model
    return out


def _layer_types(v: Any, n: int, err) -> list[str]:
    if v is None:  # the published schedule: an indexed layer every 4th, KDA elsewhere
        return [KDA if i % 4 != 3 else INDEXED for i in range(n)]
    if not isinstance(v, list) or len(v) != n:
        raise err("layer_types", f"must list {n} entries (num_hidden_layers)")
    out = []
    for t in v:
        if t == KDA:
            out.append(KDA)
        elif t in _INDEXED_ALIASES:
            out.append(INDEXED)
        else:
            raise err("layer_types", f"entry {t!r} is neither 'linear_attention' nor an indexed attention type")
    return out


def _mlp_types(v: Any, n: int, err) -> list[str]:
    if v is None:  # transformers' default (first_k_dense_replace is ignored there too)
        return ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3)
    if not isinstance(v, list) or len(v) != n or any(t not in ("dense", "sparse") for t in v):
        raise err("mlp_layer_types", f"must list {n} entries, each 'dense' or 'sparse'")
    return list(v)


def _check_indexer_types(text: dict, n: int, err) -> None:
    """Only per-layer own indexers ('full') are implemented: 'shared' layers reuse a previous layer's
    top-k, which transformers itself breaks across KDA layers (trap 12); GLM-5.3-Flash has none."""
    v = text.get("indexer_types")
    if v is None:
        pattern = text.get("index_topk_pattern")
        if pattern is not None:
            v = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        else:
            freq = max(text.get("index_topk_freq", 1) or 1, 1)
            offset = text.get("index_skip_topk_offset", 2)
            v = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(v, list) or len(v) != n:
        raise err("indexer_types", f"must list {n} entries (num_hidden_layers)")
    if any(t != "full" for t in v):
        raise err("indexer_types", "has 'shared' layers; only per-layer indexers ('full') are supported")
