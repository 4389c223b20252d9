"""The target against transformers' GlmMoeDsaForCausalLM on the same checkpoint (fp32)."""

from __future__ import annotations

import torch

from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.checkpoint.load import load_models
from glm5mtp_cli.checkpoint.resolve import resolve_model


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _load(folder):
    target, mtp, extras = load_models(resolve_model(str(folder), progress=False), "cpu", torch.float32)
    return target.eval(), mtp.eval(), extras


def test_checkpoint_exercises_every_mechanism(hf_ckpt):
    folder, hf = hf_ckpt
    cfg = hf.config
    assert cfg.n_group > 1 and "shared" in cfg.indexer_types and cfg.mlp_layer_types[0] == "dense"
    assert any(l.mlp.gate.e_score_correction_bias.abs().sum() > 0 for l in hf.model.layers[1:])


def test_logits_match_transformers_whole_prompt_and_cached_chunks(hf_ckpt):
    folder, hf = hf_ckpt
    target, mtp, extras = _load(folder)
    assert extras == {}
    cfg = target.cfg
    torch.manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    assert ids.shape[1] > 2 * cfg.index_topk  # the DSA selection is active
    with torch.no_grad():
        ref = hf(ids).logits
    pools = CachePools.create(cfg, num_blocks=40, block_size=4, dtype=torch.float32, device="cpu")
    whole = target(ids, [pools.target_cache(), pools.target_cache()]).logits
    assert _rel(whole, ref) < 1e-4
    caches = [pools.target_cache(), pools.target_cache()]
    chunks = [target(ids[:, a:b], caches).logits for a, b in [(0, 11), (11, 15), (15, 16), (16, 29), (29, 37)]]
    assert _rel(torch.cat(chunks, 1), ref) < 1e-4
    assert caches[0].length == 37


def test_sparse_selection_matters(hf_ckpt):
    """With index_topk raised to the prompt length the logits change: selection is not a no-op."""
    folder, hf = hf_ckpt
    target, _, _ = _load(folder)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 30))
    pools = CachePools.create(target.cfg, num_blocks=20, block_size=4, dtype=torch.float32, device="cpu")
    sparse = target(ids, [pools.target_cache()]).logits
    for layer in target.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk = 10_000
    dense = target(ids, [pools.target_cache()]).logits
    assert _rel(sparse, dense) > 1e-3


def test_truncating_a_cache_drops_rows(hf_ckpt):
    folder, hf = hf_ckpt
    target, _, _ = _load(folder)
    ids = torch.randint(0, target.cfg.vocab_size, (1, 20))
    with torch.no_grad():
        ref = hf(ids).logits
    pools = CachePools.create(target.cfg, num_blocks=20, block_size=4, dtype=torch.float32, device="cpu")
    cache = pools.target_cache()
    target(ids[:, :12], [cache])
    junk = torch.randint(0, target.cfg.vocab_size, (1, 5))
    target(junk, [cache])  # a rejected verify
    cache.truncate(12)
    out = target(ids[:, 12:], [cache]).logits
    assert _rel(out, ref[:, 12:]) < 1e-4


def test_fp8_checkpoint_matches_its_dequantized_twin(hf_ckpt, tmp_path):
    """The oracle checkpoint written as FP8 (e4m3 + 128x128 weight_scale_inv) loads, and its logits
    equal those of a bf16/fp32 twin holding the dequantized weights."""
    from glm5mtp_cli.checkpoint.read import CheckpointReader
    from glm5mtp_cli.checkpoint.resolve import local_weight_map
    from glm5mtp_cli.models.glm5.config import ModelConfig
    from glm5mtp_cli.checkpoint.write import save_checkpoint

    folder, _ = hf_ckpt
    cfg = ModelConfig.from_json_file(folder / "config.json")
    reader = CheckpointReader(folder, local_weight_map(folder))
    tensors = {name: reader.raw(name) for name in local_weight_map(folder)}
    save_checkpoint(tensors, cfg, tmp_path / "fp8", fp8=True)
    fp8_map = local_weight_map(tmp_path / "fp8")
    assert any(n.endswith("weight_scale_inv") for n in fp8_map)
    fp8_reader = CheckpointReader(tmp_path / "fp8", fp8_map)
    assert fp8_reader.raw("model.layers.0.self_attn.q_b_proj.weight").dtype == torch.float8_e4m3fn
    twin = {n: fp8_reader.get(n, torch.float32) for n in tensors}  # dequantized by the reader
    save_checkpoint(twin, cfg, tmp_path / "twin")
    a, _, _ = _load(tmp_path / "fp8")
    b, _, _ = _load(tmp_path / "twin")
    ids = torch.randint(0, cfg.vocab_size, (1, 25))
    pools = CachePools.create(cfg, num_blocks=30, block_size=4, dtype=torch.float32, device="cpu")
    la = a(ids, [pools.target_cache()]).logits
    lb = b(ids, [pools.target_cache()]).logits
    assert _rel(la, lb) < 1e-6
    # the FP8 weights really are rounded (routing and top-k then amplify it, so logits are not compared)
    w = tensors["model.layers.0.self_attn.q_b_proj.weight"]
    assert 1e-3 < _rel(twin["model.layers.0.self_attn.q_b_proj.weight"], w) < 0.1


def test_our_kernels_package_does_not_pose_as_huggingface_kernels():
    """transformers probes an unrelated `kernels` package; ours must not be mistaken for it."""
    import kernels
    from transformers.utils import import_utils

    assert kernels.__file__  # ours is importable beside transformers
    assert not import_utils.is_kernels_available()


def test_batched_training_forward_equals_per_sequence(hf_ckpt):
    """The cache-free (training) forward runs all sequences in one batched pass; it must equal
    running them one by one, logits and the indexer's KL loss alike, and match transformers."""
    folder, hf = hf_ckpt
    target, mtp, _ = _load(folder)
    ids = torch.randint(0, target.cfg.vocab_size, (3, 26))
    batched = target.forward_train(ids)
    singles = [target.forward_train(ids[i:i + 1]) for i in range(3)]
    assert _rel(batched.logits, torch.cat([s.logits for s in singles])) < 1e-5
    assert abs(batched.aux_loss.item() - sum(s.aux_loss.item() for s in singles) / 3) < 1e-5
    with torch.no_grad():
        assert _rel(batched.logits, hf(ids).logits) < 1e-4
    m = mtp.forward_train(batched.hidden[:, :-1], ids[:, 1:], target.model.embed_tokens, target.lm_head)
    m1 = mtp.forward_train(batched.hidden[:1, :-1], ids[:1, 1:], target.model.embed_tokens, target.lm_head)
    assert _rel(m.logits[:1], m1.logits) < 1e-5
