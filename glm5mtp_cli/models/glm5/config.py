"""ModelConfig: the GLM-5 (`glm_moe_dsa`) configuration as read from a Hugging Face config.json.

Every field the model reads lives here with the same name as in config.json. A missing required
field, a wrong type or an impossible combination raises ConfigError naming the field and the file,
so the CLI can print one line and stop.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from glm5mtp_cli.errors import UserError

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa",)


class ConfigError(UserError, ValueError):
    """A config.json that cannot describe a GLM-5 model."""


# Fields with no safe default: a config without them is not a GLM-5 config.
_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim",
    "index_topk",
)


@dataclass
class ModelConfig:
    model_type = "glm_moe_dsa"  # a class attribute, not a field: the family this config belongs to

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    max_position_embeddings: int = 202752
    first_k_dense_replace: int = 3
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    quantization_config: dict | None = None
    torch_dtype: str = "bfloat16"
    # MTP chaining: carry the post-shared_head.norm hidden between draft steps (GLM). False carries
    # the pre-norm block output instead (what DeepSeek's chaining does).
    mtp_carry_normed_hidden: bool = True
    source: str = "<dict>"

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mtp_layer_index(self) -> int:
        """The MTP layer is stored as `model.layers.{num_hidden_layers}`."""
        return self.num_hidden_layers

    @property
    def kv_cache_width(self) -> int:
        """Values cached per token per layer by MLA: the normed latent and the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def fp8(self) -> bool:
        return is_fp8(self.quantization_config)

    @property
    def fp8_block(self) -> tuple[int, int]:
        return fp8_block(self.quantization_config)

    def is_moe_layer(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:  # the MTP block is a full MoE decoder layer
            return True
        return self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        if layer >= self.num_hidden_layers:  # the MTP block has its own indexer
            return True
        return self.indexer_types[layer] == "full"

    @property
    def indexer_layers(self) -> int:
        """Target layers with their own indexer (and so indexer keys in the cache)."""
        return sum(1 for i in range(self.num_hidden_layers) if self.has_indexer(i))

    def with_layers(self, num_layers: int) -> "ModelConfig":
        """A depth-truncated copy (the first `num_layers` target layers; the MTP layer stays)."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ConfigError(f"{self.source}: --layers must be in 1..{self.num_hidden_layers}, got {num_layers}")
        return dataclasses.replace(
            self,
            num_hidden_layers=num_layers,
            mlp_layer_types=list(self.mlp_layer_types[:num_layers]),
            indexer_types=list(self.indexer_types[:num_layers]),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json body in the published layout (what init-random and train write)."""
        d: dict[str, Any] = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"}
        for f in dataclasses.fields(self):
            if f.name in ("source", "mtp_carry_normed_hidden", "quantization_config", "rope_theta", "rope_type"):
                continue
            d[f.name] = getattr(self, f.name)
        d["num_key_value_heads"] = self.num_key_value_heads or self.num_attention_heads
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": self.rope_type}
        d["rope_theta"] = self.rope_theta
        if self.quantization_config:
            d["quantization_config"] = self.quantization_config
        return d

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "<dict>") -> "ModelConfig":
        def err(name: str, msg: str) -> ConfigError:
            return ConfigError(f"{source}: field '{name}' {msg}")

        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise err("model_type", f"is {model_type!r}; glm5mtp supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in _REQUIRED:
            if raw.get(name) is None:
                raise err(name, "is missing")

        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, f in known.items():
            if name in ("source", "rope_theta", "rope_type", "eos_token_id"):
                continue
            if name in raw and raw[name] is not None:
                kwargs[name] = raw[name]
        kwargs["eos_token_id"] = _as_id_list(raw.get("eos_token_id"), source)
        kwargs["rope_theta"], kwargs["rope_type"] = _rope(raw, source)
        if "torch_dtype" not in raw and isinstance(raw.get("dtype"), str):
            kwargs["torch_dtype"] = raw["dtype"]
        cfg = cls(source=source, **kwargs)
        cfg._check_types(err)
        cfg._fill_layer_types(err)
        cfg._check_consistency(err)
        return cfg

    def _check_types(self, err) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int",) and (not isinstance(v, int) or isinstance(v, bool)):
                raise err(f.name, f"must be an integer, got {v!r}")
            if f.type == "float" and not isinstance(v, (int, float)):
                raise err(f.name, f"must be a number, got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):
                raise err(f.name, f"must be true or false, got {v!r}")
        for name in _REQUIRED + ("n_group", "topk_group", "n_shared_experts", "num_nextn_predict_layers"):
            if name in ("num_nextn_predict_layers", "n_shared_experts"):
                if getattr(self, name) < 0:
                    raise err(name, "must be >= 0")
            elif getattr(self, name) <= 0:
                raise err(name, f"must be positive, got {getattr(self, name)}")

    def _fill_layer_types(self, err) -> None:
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if not isinstance(self.mlp_layer_types, list) or len(self.mlp_layer_types) != n:
            raise err("mlp_layer_types", f"must list {n} entries (num_hidden_layers)")
        if any(t not in ("dense", "sparse") for t in self.mlp_layer_types):
            raise err("mlp_layer_types", "entries must be 'dense' or 'sparse'")
        if not isinstance(self.indexer_types, list) or len(self.indexer_types) != n:
            raise err("indexer_types", f"must list {n} entries (num_hidden_layers)")
        if any(t not in ("full", "shared") for t in self.indexer_types):
            raise err("indexer_types", "entries must be 'full' or 'shared'")
        if self.indexer_types[0] != "full":
            raise err("indexer_types", "must start with 'full': a shared layer reuses an earlier full layer's top-k")

    def _check_consistency(self, err) -> None:
        if self.num_key_value_heads != self.num_attention_heads:
            raise err("num_key_value_heads", "must equal num_attention_heads for MLA")
        if self.n_routed_experts % self.n_group:
            raise err("n_group", f"must divide n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts // self.n_group < 2:
            raise err("n_group", "needs at least 2 experts per group (groups are scored by their top 2)")
        if not 1 <= self.topk_group <= self.n_group:
            raise err("topk_group", f"must be in 1..n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise err("num_experts_per_tok", "exceeds the experts in the selected groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise err("qk_rope_head_dim", "must be even and at most index_head_dim")
        if self.topk_method != "noaux_tc":
            raise err("topk_method", f"is {self.topk_method!r}; only 'noaux_tc' is supported")
        if self.scoring_func != "sigmoid":
            raise err("scoring_func", f"is {self.scoring_func!r}; only 'sigmoid' is supported")
        if self.hidden_act != "silu":
            raise err("hidden_act", f"is {self.hidden_act!r}; only 'silu' is supported")
        if self.rope_type != "default":
            raise err("rope_parameters", f"rope_type {self.rope_type!r} is not supported (only 'default')")
        if self.num_nextn_predict_layers > 1:
            raise err("num_nextn_predict_layers", "above 1 is not supported (GLM-5 ships one MTP layer)")
        check_quantization(self.quantization_config, err)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        from glm5mtp_cli.core.families import read_config_file

        return cls.from_dict(read_config_file(path, ConfigError), source=str(path))


# An FP8 checkpoint's quantization_config (both families: GLM-5-FP8's block-scaled e4m3 layout).

def check_quantization(q: Any, err) -> None:
    """One err("quantization_config", ...) unless q is None or block-scaled FP8 with a valid block."""
    if q is None:
        return
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise err("quantization_config", "only quant_method 'fp8' is supported")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise err("quantization_config", "weight_block_size must be two positive integers")


def is_fp8(q: dict | None) -> bool:
    return (q or {}).get("quant_method") == "fp8"


def fp8_block(q: dict | None) -> tuple[int, int]:
    b = (q or {}).get("weight_block_size") or [128, 128]
    return int(b[0]), int(b[1])


def _as_id_list(v: Any, source: str) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    raise ConfigError(f"{source}: field 'eos_token_id' must be an integer or a list of integers")


def _rope(raw: dict[str, Any], source: str) -> tuple[float, str]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' must be an object")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number")
    return float(theta), str(rope_type)
