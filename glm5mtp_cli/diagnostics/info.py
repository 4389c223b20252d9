"""Sizes of a GLM-5 model computed from its config alone: parameters and checkpoint bytes per
component, active parameters per token, and cache bytes per token (REFERENCE section 5); the
byte formulas themselves live in diagnostics/sizing.py.

Every count comes from layout.tensor_shapes, the same function init-random writes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glm5mtp_cli.models.glm5 import layout
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.diagnostics.sizing import GIB, cache_bytes_per_token, cache_layers, checkpoint_tensor_bytes


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


def _count(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], into: dict[str, Part]) -> None:
    for name, shape in shapes.items():
        part = into.setdefault(layout.component_of(name), Part())
        part.add(Part(1, math.prod(shape), checkpoint_tensor_bytes(cfg, name, shape)))


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
