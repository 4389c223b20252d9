"""GLM-5-Next (`glm5_next`, GLM-5.3-Flash) as a model family: KDA layers with fixed-size recurrent
state beside NoPE MLA layers with the pooled DSA indexer (state components in pooled.py).

Importing it imports no torch (`info` reads the config alone): the methods that build, shard or
draft with the modules import them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.dtypes import dtype_name
from glm5mtp_cli.core.family import ROWS, SLOT, MtpParts, StateComponent
from glm5mtp_cli.models.glm5_next import layout, sizing
from glm5mtp_cli.models.glm5_next.config import NextConfig

if TYPE_CHECKING:
    import torch

    from glm5mtp_cli.models.glm5_next.pooled import PooledMtp, PooledTarget


class Glm5NextFamily:
    name = "glm5_next"
    model_types = ("glm5_next", "glm5_next_text")
    # --compile without the flag (engine/compiled.py): off until measured faster on the H200
    compile_default = "off"
    sizing = sizing  # the family's byte formulas (diagnostics/sizing asks them)
    mla_cache_layouts = False  # GLM-5's layouts do not apply: info's state table lists its components

    def parse_config(self, raw: dict[str, Any], source: str) -> NextConfig:
        cfg = NextConfig.from_dict(raw, source)
        if cfg.index_head_dim % cfg.index_kpool:
            raise UserError(f"{source}: index_head_dim {cfg.index_head_dim} must divide by index_kpool "
                            f"{cfg.index_kpool} (a pooled key is stored over its pool's rows)")
        return cfg

    def state_components(self, cfg: NextConfig, dtype: torch.dtype | str, with_drafter: bool = True,
                         tp: int = 1) -> list[StateComponent]:
        # KDA heads split over ranks (each rank holds its heads' states and conv channels); the MLA
        # latent and the (replicated) indexer's rows are whole on every rank
        dtype = dtype_name(dtype)
        kda, idx = len(cfg.kda_layers), len(cfg.indexed_layers)
        h, d, c = cfg.linear_num_heads // tp, cfg.linear_head_dim, cfg.linear_dim // tp
        out = [StateComponent("target_kda", "target", SLOT, kda, (h, d, d), "float32"),
               StateComponent("target_conv", "target", SLOT, kda, (cfg.linear_conv_kernel_dim - 1, 3 * c), dtype)]
        owners = [("target", idx)] + ([("drafter", 1)] if with_drafter else [])
        for owner, layers in owners:
            out += [StateComponent(f"{owner}_mla", owner, ROWS, layers, (cfg.kv_lora_rank,), dtype),
                    StateComponent(f"{owner}_pool", owner, ROWS, layers, (cfg.index_head_dim // cfg.index_kpool,), dtype),
                    StateComponent(f"{owner}_raw", owner, ROWS, layers, (2 * cfg.index_head_dim,), dtype)]
        return [c for c in out if c.layers]

    def tensor_shapes(self, cfg: NextConfig) -> list[tuple[str, tuple[int, ...]]]:
        return list(layout.checkpoint_shapes(cfg).items())

    def mtp_prefix(self, cfg: NextConfig) -> str:
        return layout.layer_prefix(cfg.mtp_layer_index)

    def build_target(self, cfg: NextConfig) -> PooledTarget:
        from glm5mtp_cli.models.glm5_next.decoder import Glm5NextForCausalLM
        from glm5mtp_cli.models.glm5_next.pooled import PooledTarget

        return PooledTarget(Glm5NextForCausalLM(cfg))

    def build_mtp(self, cfg: NextConfig) -> PooledMtp:
        from glm5mtp_cli.models.glm5_next.mtp import Glm5NextMtpLayer
        from glm5mtp_cli.models.glm5_next.pooled import PooledMtp

        return PooledMtp(Glm5NextMtpLayer(cfg))

    def component_of(self, cfg: NextConfig, name: str) -> str:
        return layout.component_of(cfg, name)

    def info_components(self, cfg: NextConfig) -> tuple[str, ...]:
        return layout.COMPONENTS

    def stored_fp32(self, name: str) -> bool:
        return layout.stored_fp32(name)

    def is_fp8_quantized(self, cfg: NextConfig, name: str, shape: tuple[int, ...]) -> bool:
        return layout.fp8_quantized(cfg, name)

    def config_dict(self, cfg: NextConfig, quantization: dict | None) -> dict[str, Any]:
        return dataclasses.replace(cfg, quantization_config=quantization).to_hf_dict()

    def transformers_model(self, folder: str, dtype: torch.dtype) -> torch.nn.Module:
        # transformers has no text-only causal LM for this model (REFERENCE-glm5next section 12): its
        # ConditionalGeneration model over the flat text config, with a one-block vision tower (not in
        # the checkpoint, never run on text) instead of the default 24-layer one
        from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

        text = Glm5NextConfig.from_pretrained(folder).text_config.to_dict()
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=text["hidden_size"],
                      projection_intermediate_size=16, patch_size=2, image_size=4, spatial_merge_size=1,
                      temporal_patch_size=1)
        cfg = Glm5NextConfig(text_config=text, vision_config=vision)
        return Glm5NextForConditionalGeneration.from_pretrained(folder, config=cfg, dtype=dtype)

    def keeps_fp32(self, name: str) -> bool:
        return layout.keeps_fp32(name)

    def check_tp(self, cfg: NextConfig, tp: int) -> None:
        from glm5mtp_cli.models.glm5_next import sharding

        sharding.check_tp(cfg, tp)

    def shard_target(self, model: PooledTarget, comm):
        from glm5mtp_cli.models.glm5_next import sharding

        return sharding.shard_target(model, comm)

    def shard_mtp(self, layer: PooledMtp, comm, prefix: str):
        from glm5mtp_cli.models.glm5_next import sharding

        return sharding.shard_mtp(layer, comm, prefix)

    def mtp_parts(self, target: PooledTarget, mtp: PooledMtp) -> MtpParts:
        # GLM-5-Next chains drafts on the post-shared_head.norm hidden (REFERENCE-glm5next section 9)
        return MtpParts(mtp, target.model.embed_tokens, target.model.lm_head, carry_normed=True)


    def split_over_ranks(self, name: str) -> bool:
        return layout.split_over_ranks(name)


FAMILY = Glm5NextFamily()
