"""resolve_model / CheckpointReader / load_module / load_models: selectivity, the Hub cache offline,
and one clear UserError per bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import huggingface_hub
import pytest
import torch
from typer.testing import CliRunner

from glm5mtp_cli.models.glm5 import layout
from glm5mtp_cli.checkpoint.load import load_models, load_module
from glm5mtp_cli.checkpoint.read import CheckpointReader
from glm5mtp_cli.checkpoint.resolve import local_weight_map, resolve_model
from glm5mtp_cli.models.glm5.family import FAMILY
from glm5mtp_cli.cli import app
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.checkpoint.write import init_random, save_checkpoint

TINY = ModelConfig.from_json_file(profile_path("glm5-tiny") / "config.json")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


# ---- stand-ins with the model's state_dict key names ---------------------------------------------

class Stub(torch.nn.Module):
    """A module whose state_dict keys/shapes are `shapes` (the routing bias a buffer, as in the model),
    plus a non-persistent buffer the loader must leave alone."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            if leaf == "e_score_correction_bias":
                mod.register_buffer(leaf, torch.zeros(shape))
            else:
                mod.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape)))
        self.register_buffer("rope_table", torch.arange(4.0), persistent=False)


def target_stub(cfg):
    shapes = {}
    for layer in layout.layer_order(cfg, mtp=False):
        shapes.update(layout.tensor_shapes(cfg, layer))
    return Stub(shapes)


def mtp_stub(cfg):
    p = f"model.layers.{cfg.mtp_layer_index}."
    return Stub({n[len(p):]: s for n, s in layout.tensor_shapes(cfg, cfg.mtp_layer_index).items()})


@pytest.fixture
def stub_model(monkeypatch):
    monkeypatch.setattr(FAMILY, "build_target", target_stub)
    monkeypatch.setattr(FAMILY, "build_mtp", mtp_stub)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """glm5-tiny with many small shards."""
    d = tmp_path_factory.mktemp("sharded")
    init_random("glm5-tiny", d, seed=11, max_shard_size="24KB")
    return d


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- resolving and selective reads -------------------------------------------------------------------

def test_profile_without_weights():
    r = resolve_model("glm5")
    assert r.kind == "profile" and not r.has_weights and r.config.hidden_size == 6144 and r.mtp_index == 78
    with pytest.raises(UserError, match="no weights"):
        load_models(r)


def test_local_need_filters_shards(sharded):
    every = set(local_weight_map(sharded).values())
    mtp = resolve_model(str(sharded), need="mtp")
    assert mtp.kind == "local" and mtp.has_weights and mtp.mtp_index == 3
    assert all(n.startswith("model.layers.3.") or not n.startswith("model.layers.") for n in mtp.weight_map)
    assert len(mtp.files) < len(every)
    tgt = resolve_model(str(sharded), need="target", layers=2)
    assert tgt.config.num_hidden_layers == 2 and tgt.mtp_index == 3
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.")) for n in tgt.weight_map)


def test_loading_mtp_opens_only_its_shards(sharded, stub_model):
    r = resolve_model(str(sharded), need="mtp")
    reader = CheckpointReader(r.folder, r.weight_map)
    mod = mtp_stub(r.config)
    load_module(mod, reader, "model.layers.3.", torch.bfloat16, keeps_fp32=FAMILY.keeps_fp32)
    mtp_files = {f for n, f in r.weight_map.items() if n.startswith("model.layers.3.")}
    assert reader.files_opened == mtp_files
    assert len(reader.files_opened) < len(set(local_weight_map(sharded).values()))


def test_load_module_dtypes_values_and_meta(sharded):
    r = resolve_model(str(sharded), need="mtp")
    reader = CheckpointReader(r.folder, r.weight_map)
    with torch.device("meta"):
        mod = mtp_stub(r.config)
    keys = load_module(mod, reader, "model.layers.3.", torch.bfloat16, keeps_fp32=FAMILY.keeps_fp32)
    assert set(keys) == set(mod.state_dict())
    assert mod.mlp.gate.weight.dtype == torch.float32 and mod.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert mod.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert mod.eh_proj.weight.dtype == torch.bfloat16 and not mod.eh_proj.weight.is_meta
    assert torch.equal(mod.eh_proj.weight, reader.get("model.layers.3.eh_proj.weight", torch.bfloat16))
    assert mod.rope_table.is_meta  # non-persistent: not the loader's business


def test_load_models_truncated_target_reads_mtp_at_original_index(sharded, stub_model):
    r = resolve_model(str(sharded), layers=2)
    target, mtp, extras = load_models(r, dtype=torch.float32)
    assert extras == {}
    assert not any(k.startswith("model.layers.2.") for k in target.state_dict())
    assert torch.equal(target.rope_table, torch.arange(4.0))  # buffers built for real, not meta
    ref = CheckpointReader(sharded, local_weight_map(sharded))
    assert torch.equal(mtp.eh_proj.weight, ref.get("model.layers.3.eh_proj.weight"))
    assert torch.equal(target.lm_head.weight, ref.get("lm_head.weight"))
    t_only, m_none, _ = load_models(resolve_model(str(sharded), need="target"))
    assert m_none is None and t_only is not None


def test_load_models_reports_mtp_own_head(tmp_path, stub_model):
    init_random("glm5-tiny", tmp_path / "m", seed=1)
    ref = CheckpointReader(tmp_path / "m", local_weight_map(tmp_path / "m"))
    tensors = {n: ref.raw(n) for n in ref.weight_map}
    tensors["model.layers.3.shared_head.head.weight"] = torch.ones(256, 64)
    save_checkpoint(tensors, TINY, tmp_path / "h")
    _, _, extras = load_models(resolve_model(str(tmp_path / "h"), need="mtp"), dtype=torch.float32)
    assert set(extras) == {"shared_head.head.weight"} and torch.all(extras["shared_head.head.weight"] == 1)


def test_real_model_keys_match_layout(sharded):
    model = pytest.importorskip("glm5mtp_cli.models.glm5")
    if not hasattr(model, "Glm5ForCausalLM"):
        pytest.skip("model not landed yet")
    target, mtp, _ = load_models(resolve_model(str(sharded)), dtype=torch.float32)
    expected = dict(layout.all_tensor_shapes(TINY))
    assert set(target.state_dict()) | {"model.layers.3." + k for k in mtp.state_dict()} == set(expected)


# ---- the Hub cache, offline ---------------------------------------------------------------------------

def _hub_cache(src, cache, repo="org/name"):
    """Lay `src` out as huggingface_hub's cache does: blobs by hash, snapshot symlinks, refs/main."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for f in sorted(os.listdir(src)):
        data = (src / f).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f).symlink_to(os.path.relpath(blob, snap))
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, sharded):
    cache = tmp_path / "hub"
    snap = _hub_cache(sharded, cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fetched = []
    real = huggingface_hub.hf_hub_download

    def spy(repo_id, filename, **kw):
        fetched.append(filename)
        return real(repo_id, filename, **kw)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    return snap, fetched


def test_hub_repo_from_offline_cache_fetches_only_needed(offline_cache, sharded):
    snap, fetched = offline_cache
    r = resolve_model("org/name", need="mtp", progress=True)
    assert r.kind == "hub" and r.folder == snap and r.mtp_index == 3
    assert fetched[:2] == ["config.json", "model.safetensors.index.json"]
    assert sorted(fetched[2:]) == r.files
    assert len(r.files) < len(set(local_weight_map(sharded).values()))
    reader = CheckpointReader(r.folder, r.weight_map)
    assert reader.get("model.layers.3.eh_proj.weight").shape == (64, 128)


def test_hub_offline_missing_shard_and_unknown_model(offline_cache):
    snap, _ = offline_cache
    r = resolve_model("org/name", need="mtp", progress=False)
    victim = r.files[-1]
    (snap / victim).unlink()
    with pytest.raises(UserError, match=victim):
        resolve_model("org/name", need="mtp", progress=False)
    with pytest.raises(UserError) as e:
        resolve_model("org/unknown")
    assert str(e.value) == ("model 'org/unknown' not found: not a profile, not a local folder, "
                            "and not in the Hugging Face cache (offline)")


def test_hf_home_is_honoured(tmp_path, monkeypatch, sharded):
    _hub_cache(sharded, tmp_path / "home" / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/name", need="target", layers=1, progress=False).config.num_hidden_layers == 1


# ---- every bad input: one UserError naming the file or tensor -------------------------------------------

def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_missing_shard(tmp_path, sharded):
    d = _copy(sharded, tmp_path / "m")
    f = _index(d)["weight_map"]["model.layers.3.eh_proj.weight"]
    (d / f).unlink()
    with pytest.raises(UserError, match=f"shard file '{f}'.*missing"):
        resolve_model(str(d))
    with pytest.raises(UserError, match=f):
        CheckpointReader(d, local_weight_map(d)).get("model.layers.3.eh_proj.weight")


def test_missing_tensor(tmp_path, sharded, stub_model):
    d = _copy(sharded, tmp_path / "m")
    idx = _index(d)
    del idx["weight_map"]["model.layers.3.enorm.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(UserError, match=r"'model\.layers\.3\.enorm\.weight' is missing"):
        load_models(resolve_model(str(d), need="mtp"))
    # listed in the index under a shard that does not hold it
    idx["weight_map"]["model.layers.3.enorm.weight"] = idx["weight_map"]["lm_head.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(UserError, match=r"enorm\.weight' is listed under 'model-\d+-of-\d+\.safetensors'"):
        load_models(resolve_model(str(d), need="mtp"))


def test_wrong_shape(tmp_path, sharded):
    r = resolve_model(str(sharded), need="mtp")
    cfg = ModelConfig.from_dict({**TINY.to_hf_dict(), "hidden_size": 32}, source="x")
    mod = Stub({"eh_proj.weight": (cfg.hidden_size, 2 * cfg.hidden_size)})
    with pytest.raises(UserError, match=r"model\.layers\.3\.eh_proj\.weight' in '.*\.safetensors' has shape \[64, 128\], expected \[32, 64\]"):
        load_module(mod, CheckpointReader(r.folder, r.weight_map), "model.layers.3.", torch.float32)


def test_truncated_and_garbage_shard(tmp_path, sharded):
    d = _copy(sharded, tmp_path / "m")
    f = _index(d)["weight_map"]["model.layers.3.eh_proj.weight"]
    data = (d / f).read_bytes()
    (d / f).write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=f"{f}.*corrupt or unreadable"):
        CheckpointReader(d, local_weight_map(d)).get("model.layers.3.eh_proj.weight")
    (d / f).write_bytes(b"\x00garbage")
    with pytest.raises(UserError, match=f):
        CheckpointReader(d, local_weight_map(d)).shape("model.layers.3.eh_proj.weight")
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(UserError, match="model.safetensors.index.json"):
        resolve_model(str(d))


def test_stored_itemsize_reads_the_header_and_refuses_a_packed_dtype(tmp_path):
    """quantize sizes what it writes from the stored dtypes; a dtype below a byte (F4) is one line."""
    import struct

    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float8_e4m3fn)},
              str(tmp_path / "m.safetensors"))
    header = json.dumps({"w": {"dtype": "F4", "shape": [2, 2], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "f4.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2))
    reader = CheckpointReader(tmp_path, {"a": "m.safetensors", "b": "m.safetensors", "w": "f4.safetensors"})
    assert (reader.stored_itemsize("a"), reader.stored_itemsize("b")) == (2, 1)
    with pytest.raises(UserError, match=r"tensor 'w' in '.*f4\.safetensors' is stored as F4, a dtype glm5mtp does not"):
        reader.stored_itemsize("w")


@pytest.mark.parametrize("body, match", [
    ("{oops", "not valid JSON"),
    ('["a"]', "not a JSON object"),
    ('{"model_type": "llama"}', "model_type"),
    ('{"model_type": "glm_moe_dsa"}', "is missing"),
])
def test_bad_config(tmp_path, body, match):
    (tmp_path / "config.json").write_text(body)
    with pytest.raises(UserError, match=match):
        resolve_model(str(tmp_path))


def test_unknown_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(UserError, match="not a profile .*not a local folder"):
        resolve_model("no-such-thing")
    with pytest.raises(UserError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        resolve_model(str(tmp_path / "f.txt"))
    with pytest.raises(UserError, match="--layers must be in 1..3"):
        resolve_model("glm5-tiny", layers=7)


def test_cli_bad_model_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text('{"model_type": "llama"}')
    for spec in ("org/x", "no-such-thing", str(tmp_path / "bad")):
        r = CliRunner().invoke(app, ["info", spec])
        assert r.exit_code == 2, r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
