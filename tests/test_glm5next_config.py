"""NextConfig: nested and flat config.json, checkpoint spellings, and one-line errors."""

import copy
import json

import pytest

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5_next import layout
from glm5mtp_cli.models.glm5_next.config import INDEXED, KDA, NextConfig
import torch

from glm5mtp_cli.core.families import family_of

NESTED = json.loads((profile_path("glm5next-tiny") / "config.json").read_text())


def _nested(**text_overrides):
    raw = copy.deepcopy(NESTED)
    raw["text_config"].update(text_overrides)
    return raw


def test_nested_and_flat_configs_agree():
    nested = NextConfig.from_dict(_nested())
    flat_raw = dict(NESTED["text_config"], model_type="glm5_next")
    flat = NextConfig.from_dict(flat_raw)
    for f in ("layer_types", "mlp_layer_types", "index_kpool", "linear_num_heads", "linear_head_dim",
              "linear_conv_kernel_dim", "linear_lower_bound", "hidden_size"):
        assert getattr(nested, f) == getattr(flat, f)
    # checkpoint spelling deepseek_sparse_attention is an indexed layer
    assert nested.layer_types == [KDA, INDEXED, KDA, INDEXED]
    assert nested.mtp_layer_index == nested.num_hidden_layers == 4


def test_published_profile():
    cfg = NextConfig.from_json_file(profile_path("glm5next") / "config.json")
    assert len(cfg.kda_layers) == 34 and cfg.indexed_layers == list(range(3, 45, 4))
    assert cfg.index_kpool == 4 and cfg.linear_num_heads == 64 and cfg.linear_head_dim == 128
    assert cfg.mlp_layer_types[:4] == ["dense"] * 3 + ["sparse"]
    sizes = {c.name: c.unit_bytes for c in family_of(cfg).state_components(cfg, torch.bfloat16, with_drafter=False)}
    assert sizes["target_kda"] == 34 * 4 * 2**20          # 136 MiB fp32, one slot per sequence
    assert sizes["target_conv"] == 34 * 147456            # 3 bf16 columns, one slot per sequence
    assert sizes["target_mla"] == 11 * 1024               # per token
    assert sizes["target_pool"] == 11 * 64                # per token: 128 bf16 per 4 tokens
    shapes = layout.checkpoint_shapes(cfg)
    assert shapes["model.language_model.layers.0.hc_attn_fn"] == (24, 16384)
    assert shapes["model.language_model.layers.3.self_attn.indexer.index_kpool_compress_ape"] == (4, 128)
    assert shapes["model.language_model.layers.45.eh_proj.weight"] == (4096, 8192)
    assert not any(k.startswith("model.language_model.layers.45.hc_") for k in shapes)


def test_index_share_for_mtp_iteration_is_read_with_the_published_default():
    """Absent: true, as GLM-5.3-Flash's config; a config's own value wins; a non-bool is refused."""
    assert "index_share_for_mtp_iteration" not in NESTED["text_config"]
    assert NextConfig.from_dict(_nested()).index_share_for_mtp_iteration is True
    assert NextConfig.from_dict(_nested(index_share_for_mtp_iteration=False)).index_share_for_mtp_iteration is False
    assert NextConfig.from_json_file(profile_path("glm5next") / "config.json").index_share_for_mtp_iteration is True
    with pytest.raises(UserError, match="index_share_for_mtp_iteration"):
        NextConfig.from_dict(_nested(index_share_for_mtp_iteration="yes"))


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.pop("index_kpool"), "index_kpool' is missing"),
    (lambda t: t.update(index_topk=10), "divisible by index_kpool"),
    (lambda t: t.update(qk_rope_head_dim=8), "NoPE"),
    (lambda t: t.update(layer_types=["linear_attention"] * 3), "layer_types"),
    (lambda t: t.update(indexer_types=["full", "shared", "full", "full"]), "shared"),
    (lambda t: t.pop("linear_attn_config"), "linear_attn_config"),
])
def test_config_errors_are_one_line(mutate, match):
    raw = _nested()
    mutate(raw["text_config"])
    with pytest.raises(UserError, match=match) as e:
        NextConfig.from_dict(raw, source="x/config.json")
    assert "\n" not in str(e.value) and "x/config.json" in str(e.value)


def test_wrong_model_type():
    with pytest.raises(UserError, match="model_type"):
        NextConfig.from_dict(dict(NESTED, model_type="glm_moe_dsa"))
