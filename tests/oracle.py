"""Test checkpoints written by transformers' GlmMoeDsaForCausalLM (the oracle), with MTP weights added.

transformers has the GLM-5 target but no MTP layer, so the MTP tensors (`model.layers.{N}.*`) are
added in a second shard with an index, exactly as the Hub's sharded checkpoints lay them out.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.models.glm5.decoder import Glm5MtpLayer

TINY_RAW = json.loads((profile_path("glm5-tiny") / "config.json").read_text())
_NOT_HF = ("architectures", "model_type", "torch_dtype", "rope_theta", "rope_interleave", "indexer_rope_interleave",
           "num_nextn_predict_layers")


def hf_model(seed: int = 0, output_scale: float = 1.0):
    """A random GlmMoeDsaForCausalLM of the glm5-tiny shape.

    Weights are larger than transformers' init (std 0.2) so logits differ by far more than fp32
    rounding and greedy choices cannot flip; the router gets a nonzero correction bias.
    output_scale < 1 shrinks every attention and MLP output, which makes the target close to a
    bigram model that a mirrored MTP layer predicts well (to exercise acceptance paths).
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    hcfg = GlmMoeDsaConfig(**{k: v for k, v in TINY_RAW.items() if k not in _NOT_HF}, attn_implementation="eager")
    model = GlmMoeDsaForCausalLM(hcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if name.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2)
            if any(name.endswith(s) for s in ("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(output_scale)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        if output_scale < 1.0:
            model.model.norm.weight.fill_(1.0)  # so an MTP layer with unit norms can mirror it
    return model


def mtp_tensors(cfg: ModelConfig, seed: int, mirror: float | None = None) -> dict[str, torch.Tensor]:
    """Random MTP layer tensors named as in a checkpoint (`model.layers.{N}.`).

    mirror: when set, eh_proj passes the embedding half through (plus `mirror` times noise) and the
    block's outputs are nearly zero, so the drafter approximates a bigram target's next-next token.
    """
    torch.manual_seed(seed)
    layer = Glm5MtpLayer(cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "bias" not in name else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2)
        layer.block.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        layer.block.self_attn.indexer.k_norm.bias.normal_(0, 0.1)
        if mirror is not None:
            h = cfg.hidden_size
            eh = torch.zeros(h, 2 * h)
            eh[:, :h] = torch.eye(h)
            layer.eh_proj.weight.copy_(eh + mirror * torch.randn_like(eh))
            for norm in (layer.enorm, layer.hnorm, layer.shared_head.norm):
                norm.weight.fill_(1.0)
            layer.block.self_attn.o_proj.weight.mul_(0.01)
            layer.block.mlp.experts.down.mul_(0.01)
            layer.block.mlp.shared_experts.down_proj.weight.mul_(0.01)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return {prefix + k: v.contiguous() for k, v in layer.state_dict().items()}


def write_with_mtp(model, folder: Path, mtp_seed: int = 1, mirror: float | None = None) -> Path:
    """save_pretrained, then the MTP layer in a second shard and a Hub-style index over both."""
    model.save_pretrained(folder)
    single = folder / "model.safetensors"
    first = folder / "model-00001-of-00002.safetensors"
    single.rename(first)
    cfg = ModelConfig.from_json_file(folder / "config.json")
    mtp = mtp_tensors(cfg, mtp_seed, mirror)
    save_file(mtp, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    from safetensors import safe_open

    with safe_open(first, "pt") as f:
        names = list(f.keys())
    weight_map = {n: first.name for n in names}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in mtp})
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder
