"""Sizes of a GLM-5 model computed from its config alone: parameters and checkpoint bytes per
component, active parameters per token, and cache bytes per token (REFERENCE section 5).

Every count comes from layout.tensor_shapes, the same function init-random writes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glm5mtp_cli.models.glm5 import layout
from glm5mtp_cli.models.glm5.config import ModelConfig

GIB = 2**30
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}
BF16 = 2


@dataclass
class Part:
    tensors: int = 0
    params: int = 0
    bytes: int = 0

    def add(self, other: "Part") -> None:
        self.tensors += other.tensors
        self.params += other.params
        self.bytes += other.bytes


@dataclass
class ModelInfo:
    config: ModelConfig
    target: dict[str, Part] = field(default_factory=dict)   # component -> totals over target layers
    mtp: dict[str, Part] = field(default_factory=dict)      # component -> the MTP layer's own

    def total(self, parts: dict[str, Part]) -> Part:
        t = Part()
        for p in parts.values():
            t.add(p)
        return t


def weight_dtype_bytes(cfg: ModelConfig) -> int:
    return _DTYPE_BYTES.get(str(cfg.torch_dtype).lower(), 2)


def tensor_bytes(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> int:
    """Bytes a checkpoint stores for one tensor (fp8: 1 byte a weight plus fp32 block scales)."""
    n = math.prod(shape)
    if layout.stored_fp32(name):
        return 4 * n
    if cfg.fp8 and layout.is_fp8_quantized(name, shape):
        b0, b1 = cfg.fp8_block
        return n + 4 * (-(-shape[0] // b0)) * (-(-shape[1] // b1))
    return weight_dtype_bytes(cfg) * n


def _count(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], into: dict[str, Part]) -> None:
    for name, shape in shapes.items():
        part = into.setdefault(layout.component_of(name), Part())
        part.add(Part(1, math.prod(shape), tensor_bytes(cfg, name, shape)))


def model_info(cfg: ModelConfig) -> ModelInfo:
    info = ModelInfo(cfg)
    for layer in layout.layer_order(cfg, mtp=False):
        _count(cfg, layout.tensor_shapes(cfg, layer), info.target)
    if cfg.num_nextn_predict_layers:
        _count(cfg, layout.tensor_shapes(cfg, cfg.mtp_layer_index), info.mtp)
    return info


def active_params(cfg: ModelConfig, parts: dict[str, Part]) -> int:
    """Parameters read per token: everything but routed experts, plus top-k of them (the shared
    expert is always on). Embeddings count in full, as published totals do."""
    routed = parts.get("routed experts", Part()).params
    rest = sum(p.params for k, p in parts.items() if k != "routed experts")
    return rest + routed * cfg.num_experts_per_tok // cfg.n_routed_experts


def cache_bytes_per_token(cfg: ModelConfig) -> dict[str, int]:
    """Bytes per token per layer for each cache layout (REFERENCE section 5)."""
    block = 128  # one fp32 scale per 128 values in the fp8 layouts
    return {
        "mla_bf16": cfg.kv_cache_width * BF16,
        # vLLM fp8_ds_mla: latent in fp8 with fp32 scales per 128, rope part kept bf16
        "mla_fp8": cfg.kv_lora_rank + 4 * (-(-cfg.kv_lora_rank // block)) + cfg.qk_rope_head_dim * BF16,
        "indexer_bf16": cfg.index_head_dim * BF16,
        "indexer_fp8": cfg.index_head_dim + 4 * (-(-cfg.index_head_dim // block)),
    }


def cache_layers(cfg: ModelConfig) -> dict[str, int]:
    """Layers holding each cache: every layer has MLA; only 'full' indexer layers keep index keys."""
    mtp = 1 if cfg.num_nextn_predict_layers else 0
    full = sum(1 for i in range(cfg.num_hidden_layers) if cfg.has_indexer(i))
    return {"mla_target": cfg.num_hidden_layers, "indexer_target": full, "mla_mtp": mtp, "indexer_mtp": mtp}


def _part_dict(p: Part) -> dict[str, int]:
    return {"tensors": p.tensors, "params": p.params, "bytes": p.bytes}


def info_dict(cfg: ModelConfig, tokens: int = 131072, model: str = "") -> dict:
    """The whole report as one JSON-ready document."""
    info = model_info(cfg)
    tgt, mtp = info.total(info.target), info.total(info.mtp)
    everything = {k: Part() for k in layout.COMPONENTS}
    for parts in (info.target, info.mtp):
        for k, p in parts.items():
            everything[k].add(p)
    per_tok = cache_bytes_per_token(cfg)
    lay = cache_layers(cfg)
    caches = {}
    for kind, per_layer in per_tok.items():
        family = "mla" if kind.startswith("mla") else "indexer"
        t_layers, m_layers = lay[f"{family}_target"], lay[f"{family}_mtp"]
        caches[kind] = {
            "bytes_per_token_per_layer": per_layer,
            "bytes_per_token_target": per_layer * t_layers,
            "bytes_per_token_mtp": per_layer * m_layers,
            "bytes_per_token_all": per_layer * (t_layers + m_layers),
            "bytes_at_tokens_all": per_layer * (t_layers + m_layers) * tokens,
            "bytes_at_tokens_mtp": per_layer * m_layers * tokens,
            "gib_at_tokens_all": round(per_layer * (t_layers + m_layers) * tokens / GIB, 3),
        }
    return {
        "model": model,
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": cfg.num_hidden_layers,
        "mtp_layer_index": cfg.mtp_layer_index,
        "checkpoint_dtype": "fp8-e4m3 (block scales)" if cfg.fp8 else str(cfg.torch_dtype),
        "components": {k: {"target": _part_dict(info.target.get(k, Part())), "mtp": _part_dict(info.mtp.get(k, Part())),
                           "all": _part_dict(p)} for k, p in everything.items()},
        "totals": {
            "target": _part_dict(tgt), "mtp_layer": _part_dict(mtp),
            "all": _part_dict(Part(tgt.tensors + mtp.tensors, tgt.params + mtp.params, tgt.bytes + mtp.bytes)),
            "active_params_per_token_target": active_params(cfg, info.target),
            "active_params_per_token_mtp": active_params(cfg, info.mtp),
        },
        "cache": {"tokens": tokens, "layers": lay, "per_kind": caches},
    }
