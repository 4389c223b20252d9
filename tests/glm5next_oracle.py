"""GLM-5-Next test checkpoints written by transformers' Glm5NextForConditionalGeneration (the oracle),
with the MTP layer added.

transformers has the GLM-5-Next target but no MTP layer, so the MTP tensors
(`model.language_model.layers.{N}.*`) go into a second shard with a Hub-style index, exactly as
real sharded checkpoints lay them out. The oracle runs in fp32 on its torch fallbacks (no `fla`).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5_next import layout
from glm5mtp_cli.models.glm5_next.config import NextConfig

TINY_RAW = json.loads((profile_path("glm5next-tiny") / "config.json").read_text())
# The smallest vision tower transformers accepts: only so the multimodal class can be built.
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
                   projection_intermediate_size=16, patch_size=2, image_size=4, spatial_merge_size=1,
                   temporal_patch_size=1)


def tiny_text(**overrides) -> dict:
    text = copy.deepcopy(TINY_RAW["text_config"])
    text.update(overrides)
    return text


def hf_model(seed: int = 0, text: dict | None = None):
    """A random Glm5NextForConditionalGeneration of the tiny shape, fp32, eager attention.

    Weights are larger than transformers' init so logits differ by far more than fp32 rounding;
    dense/expert gate and up projections are larger still so the SwiGLU clamp (10) is exercised.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config=text or tiny_text(), vision_config=dict(TINY_VISION))
    cfg.text_config._attn_implementation = "eager"
    model = Glm5NextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("scale") and "hc" in name:
                p.copy_(0.5 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("weight") else p.normal_(0, 0.1)
            elif "mlp" in name and any(s in name for s in ("gate_proj", "up_proj", "gate_up_proj")):
                p.normal_(0, 0.8)
            else:
                p.normal_(0, 0.2)
        model.lm_head.weight.normal_(0, 0.2)
        for layer in model.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens[None]).logits[0]


def mtp_tensors(cfg: NextConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP layer tensors named as in a checkpoint (`model.language_model.layers.{N}.`)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in layout.mtp_shapes(cfg).items():
        t = torch.randn(shape, generator=g)
        if len(shape) == 1:
            t = 1.0 + 0.1 * t if key.endswith("weight") else 0.1 * t
        else:
            t = 0.2 * t
        out[layout.layer_prefix(cfg.mtp_layer_index) + key] = t.contiguous()
    return out


def write_checkpoint(model, folder: Path, mtp_seed: int | None = 1) -> Path:
    """save_pretrained (real layout: model.language_model.*, lm_head, model.visual.*), then the MTP
    layer in a second shard and an index over both (mtp_seed None: no MTP layer)."""
    folder = Path(folder)
    model.save_pretrained(folder)
    single, first = folder / "model.safetensors", folder / "model-00001-of-00002.safetensors"
    single.rename(first)
    with safe_open(str(first), "pt") as f:
        weight_map = {n: first.name for n in f.keys()}
    if mtp_seed is not None:
        cfg = NextConfig.from_json_file(folder / "config.json")
        mtp = mtp_tensors(cfg, mtp_seed)
        second = "model-00002-of-00002.safetensors"
        save_file(mtp, folder / second, metadata={"format": "pt"})
        weight_map.update({n: second for n in mtp})
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder
