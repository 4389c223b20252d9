"""GLM-5 (`glm_moe_dsa`) as a model family: absorbed MLA + DSA indexer caches, all paged rows.

Importing it imports no torch (`info` reads the config alone): the methods that build, shard or
draft with the modules import them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from glm5mtp_cli.core.dtypes import dtype_name
from glm5mtp_cli.core.family import ROWS, MtpParts, StateComponent
from glm5mtp_cli.models.glm5 import layout, sizing
from glm5mtp_cli.models.glm5.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from glm5mtp_cli.models.glm5.decoder import Glm5ForCausalLM, Glm5MtpLayer


class Glm5Family:
    name = "glm5"
    model_types = ("glm_moe_dsa",)
    # --compile without the flag (engine/compiled.py): off until measured faster on the H200
    compile_default = "off"
    sizing = sizing  # the family's byte formulas (diagnostics/sizing asks them)
    mla_cache_layouts = True

    def parse_config(self, raw: dict[str, Any], source: str) -> ModelConfig:
        return ModelConfig.from_dict(raw, source)

    def state_components(self, cfg: ModelConfig, dtype: torch.dtype | str, with_drafter: bool = True,
                         tp: int = 1) -> list[StateComponent]:
        # the MLA latent and the indexer keys are shared by all heads: every rank keeps them whole
        dtype = dtype_name(dtype)
        out = [StateComponent("target_mla", "target", ROWS, cfg.num_hidden_layers, (cfg.kv_cache_width,), dtype),
               StateComponent("target_indexer", "target", ROWS, cfg.indexer_layers, (cfg.index_head_dim,), dtype)]
        if with_drafter:
            out += [StateComponent("drafter_mla", "drafter", ROWS, 1, (cfg.kv_cache_width,), dtype),
                    StateComponent("drafter_indexer", "drafter", ROWS, 1, (cfg.index_head_dim,), dtype)]
        return out

    def tensor_shapes(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        return list(layout.all_tensor_shapes(cfg))

    def mtp_prefix(self, cfg: ModelConfig) -> str:
        return f"model.layers.{cfg.mtp_layer_index}."

    def build_target(self, cfg: ModelConfig) -> Glm5ForCausalLM:
        from glm5mtp_cli.models.glm5.decoder import Glm5ForCausalLM

        return Glm5ForCausalLM(cfg)

    def build_mtp(self, cfg: ModelConfig) -> Glm5MtpLayer:
        from glm5mtp_cli.models.glm5.decoder import Glm5MtpLayer

        return Glm5MtpLayer(cfg)

    def component_of(self, cfg: ModelConfig, name: str) -> str:
        return layout.component_of(name)

    def info_components(self, cfg: ModelConfig) -> tuple[str, ...]:
        return layout.COMPONENTS

    def stored_fp32(self, name: str) -> bool:
        return layout.stored_fp32(name)

    def is_fp8_quantized(self, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> bool:
        return layout.is_fp8_quantized(name, shape)

    def config_dict(self, cfg: ModelConfig, quantization: dict | None) -> dict[str, Any]:
        return dataclasses.replace(cfg, quantization_config=quantization).to_hf_dict()

    def transformers_model(self, folder: str, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import GlmMoeDsaForCausalLM

        return GlmMoeDsaForCausalLM.from_pretrained(folder, dtype=dtype)

    def keeps_fp32(self, name: str) -> bool:
        return layout.keeps_fp32(name)

    def check_tp(self, cfg: ModelConfig, tp: int) -> None:
        from glm5mtp_cli.models.glm5 import sharding

        sharding.check_tp(cfg, tp)

    def shard_target(self, model, comm):
        from glm5mtp_cli.models.glm5 import sharding

        return sharding.shard_target(model, comm)

    def shard_mtp(self, layer, comm, prefix: str):
        from glm5mtp_cli.models.glm5 import sharding

        return sharding.shard_mtp(layer, comm, prefix)

    def mtp_parts(self, target, mtp) -> MtpParts:
        return MtpParts(mtp, target.model.embed_tokens, target.lm_head, carry_normed=mtp.cfg.mtp_carry_normed_hidden)


    def split_over_ranks(self, name: str) -> bool:
        return layout.split_over_ranks(name)


FAMILY = Glm5Family()
