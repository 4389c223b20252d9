"""Build the GLM-5-Next target and its MTP layer from a checkpoint folder in the real layout.

Modules are built on the meta device (no memory), given real storage once (fp32 where the math
needs it, layout.keeps_fp32), then every state_dict entry is read lazily through the project's
CheckpointReader: only the tensors the modules name are read, so `model.visual.*` is never touched.
Problems with the files are one-line UserErrors: no config, no MTP layer, a missing or truncated
shard, a tensor of the wrong shape.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from glm5mtp_cli.checkpoint.read import CheckpointReader
from glm5mtp_cli.checkpoint.resolve import local_weight_map
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models.glm5_next import layout
from glm5mtp_cli.models.glm5_next.config import NextConfig
from glm5mtp_cli.models.glm5_next.decoder import Glm5NextForCausalLM
from glm5mtp_cli.models.glm5_next.mtp import Glm5NextMtpLayer


def _materialize(module: nn.Module, dtype: torch.dtype, device) -> None:
    """Real, uninitialised storage for every parameter and persistent buffer (fp32 where needed)."""
    for mod_name, mod in module.named_modules():
        pre = mod_name + "." if mod_name else ""
        for table in (mod._parameters, mod._buffers):
            for n, t in list(table.items()):
                if t is None:
                    continue
                want = torch.float32 if layout.keeps_fp32(pre + n) else dtype
                new = torch.empty(t.shape, dtype=want, device=device)
                table[n] = nn.Parameter(new, requires_grad=False) if isinstance(t, nn.Parameter) else new


def fill_module(module: nn.Module, reader, to_name, dtype: torch.dtype, device="cpu") -> list[str]:
    """Materialize `module` and copy every state_dict entry from `reader` at checkpoint name
    to_name(key), checking shapes. Returns the checkpoint names read."""
    _materialize(module, dtype, device)
    read = []
    for key, dst in module.state_dict(keep_vars=True).items():
        name = to_name(key)
        if not reader.has(name):
            raise UserError(f"tensor '{name}' is missing from the checkpoint at {reader.folder}")
        found = tuple(reader.shape(name))
        if found != tuple(dst.shape):
            raise UserError(f"tensor '{name}' in '{reader.folder / reader.file_of(name)}' has shape "
                            f"{list(found)}, expected {list(dst.shape)}")
        with torch.no_grad():
            dst.copy_(reader.get(name, dst.dtype, dst.device))
        read.append(name)
    return read


def open_checkpoint(folder: str | os.PathLike) -> tuple[NextConfig, CheckpointReader]:
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"model folder '{folder}' has no config.json")
    cfg = NextConfig.from_json_file(folder / "config.json")
    wm = local_weight_map(folder)
    if not wm:
        raise UserError(f"model folder '{folder}' has no safetensors weights")
    for f in sorted(set(wm.values())):
        if not (folder / f).is_file():
            raise UserError(f"shard file '{f}' listed in the index of {folder} is missing")
    return cfg, CheckpointReader(folder, wm)


def load_target(cfg: NextConfig, reader, dtype=torch.bfloat16, device="cpu") -> Glm5NextForCausalLM:
    with torch.device("meta"):
        model = Glm5NextForCausalLM(cfg)
    fill_module(model, reader, lambda k: k if k == layout.LM_HEAD else layout.PREFIX + k, dtype, device)
    return model.eval()


def load_mtp(cfg: NextConfig, reader, dtype=torch.bfloat16, device="cpu") -> Glm5NextMtpLayer:
    prefix = layout.layer_prefix(cfg.mtp_layer_index)
    if not any(n.startswith(prefix) for n in reader.weight_map):
        raise UserError(f"checkpoint at {reader.folder} has no MTP layer (no '{prefix}*' tensors)")
    with torch.device("meta"):
        layer = Glm5NextMtpLayer(cfg)
    fill_module(layer, reader, lambda k: prefix + k, dtype, device)
    return layer.eval()


def load_next(folder: str | os.PathLike, dtype=torch.bfloat16, device="cpu", mtp: bool = True):
    """(config, target, MTP layer or None) from a checkpoint folder."""
    cfg, reader = open_checkpoint(folder)
    try:
        target = load_target(cfg, reader, dtype, device)
        layer = load_mtp(cfg, reader, dtype, device) if mtp else None
    finally:
        reader.close()
    return cfg, target, layer
