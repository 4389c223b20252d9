"""Sizes of a model computed from its config alone: parameters and checkpoint bytes per
component, active parameters per token, and cache bytes per token (REFERENCE section 5); the
byte formulas themselves live in diagnostics/sizing.py.

Every count comes from layout.tensor_shapes, the same function init-random writes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.core.family import ROWS
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


def model_info(cfg) -> ModelInfo:
    """Parameters and checkpoint bytes per component of the target and of the MTP layer."""
    family = family_of(cfg)
    info = ModelInfo(cfg)
    mtp = family.mtp_prefix(cfg)
    for name, shape in family.tensor_shapes(cfg):
        into = info.mtp if name.startswith(mtp) else info.target
        part = into.setdefault(family.component_of(cfg, name), Part())
        part.add(Part(1, math.prod(shape), checkpoint_tensor_bytes(cfg, name, shape)))
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
    family = family_of(cfg)
    everything = {k: Part() for k in family.info_components(cfg)}
    for parts in (info.target, info.mtp):
        for k, p in parts.items():
            everything[k].add(p)
    doc = {
        "model": model,
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "mtp_layer_index": cfg.mtp_layer_index,
        "checkpoint_dtype": "fp8-e4m3 (block scales)" if getattr(cfg, "fp8", False) else str(cfg.torch_dtype),
        "components": {k: {"target": _part_dict(info.target.get(k, Part())), "mtp": _part_dict(info.mtp.get(k, Part())),
                           "all": _part_dict(p)} for k, p in everything.items()},
        "totals": {
            "target": _part_dict(tgt), "mtp_layer": _part_dict(mtp),
            "all": _part_dict(Part(tgt.tensors + mtp.tensors, tgt.params + mtp.params, tgt.bytes + mtp.bytes)),
            "active_params_per_token_target": active_params(cfg, info.target),
            "active_params_per_token_mtp": active_params(cfg, info.mtp),
        },
        "state": state_doc(cfg, tokens),
    }
    if family.mla_cache_layouts:
        doc["cache"] = cache_doc(cfg, tokens)
    return doc


def state_doc(cfg, tokens: int) -> dict:
    """Per-sequence state by component (bf16; recurrent state as the family keeps it): rows that
    grow with tokens, slots that do not, and their bytes at `tokens` tokens."""
    comps = family_of(cfg).state_components(cfg, "bfloat16")
    rows = {c.name: {"kind": c.kind, "layers": c.layers, "dtype": c.dtype,
                     "bytes_per_token": c.unit_bytes if c.kind == ROWS else 0,
                     "bytes_per_sequence": 0 if c.kind == ROWS else c.unit_bytes,
                     "bytes_at_tokens": c.bytes_for(tokens)} for c in comps}
    return {"tokens": tokens, "components": rows, "total_at_tokens": sum(r["bytes_at_tokens"] for r in rows.values())}


def cache_doc(cfg, tokens: int) -> dict:
    """GLM-5's MLA and indexer cache layouts compared (bf16 vs fp8, REFERENCE section 5)."""
    per_tok = cache_bytes_per_token(cfg)
    lay = cache_layers(cfg)
    caches = {}
    for kind, per_layer in per_tok.items():
        part = "mla" if kind.startswith("mla") else "indexer"
        t_layers, m_layers = lay[f"{part}_target"], lay[f"{part}_mtp"]
        caches[kind] = {
            "bytes_per_token_per_layer": per_layer,
            "bytes_per_token_target": per_layer * t_layers,
            "bytes_per_token_mtp": per_layer * m_layers,
            "bytes_per_token_all": per_layer * (t_layers + m_layers),
            "bytes_at_tokens_all": per_layer * (t_layers + m_layers) * tokens,
            "bytes_at_tokens_mtp": per_layer * m_layers * tokens,
            "gib_at_tokens_all": round(per_layer * (t_layers + m_layers) * tokens / GIB, 3),
        }
    return {"tokens": tokens, "layers": lay, "per_kind": caches}
