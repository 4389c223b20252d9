"""The target against transformers' GlmMoeDsaForCausalLM on the same checkpoint (fp32)."""

from __future__ import annotations

import torch

from glm5mtp_cli.cache import CachePools
from glm5mtp_cli.checkpoint import load_models, resolve_model


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
