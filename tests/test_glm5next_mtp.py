"""GLM-5-Next MTP layer against the math written here with plain tensor ops from the checkpoint
tensors (transformers has no MTP layer), and loading errors of the real-layout checkpoint."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from glm5next_oracle import hf_model, write_checkpoint  # noqa: E402
from glm5next_reference import Mtp, Target, boundary_ties  # noqa: E402

from glm5mtp_cli.errors import UserError  # noqa: E402
from glm5mtp_cli.models.glm5_next import layout  # noqa: E402
from glm5mtp_cli.models.glm5_next.load import load_mtp, load_next, load_target, open_checkpoint  # noqa: E402

MTP_SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = write_checkpoint(hf_model(seed=1), tmp_path_factory.mktemp("glm5next_mtp"))
    cfg, target, mtp = load_next(folder, torch.float32)
    return folder, cfg, Target(target), Mtp(mtp)  # the one-sequence reference path


def checkpoint_tensors(folder):
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys() if not layout.is_visual(k)})
    return out


def reference_mtp(t, cfg, tokens_next, hiddens):
    """Logits of MTP rows 0..N-1 from (t[i+1], h[i]): plain ops, expanded (not absorbed) MLA, a
    per-query loop over pools for the indexer."""
    pre = layout.layer_prefix(cfg.mtp_layer_index)
    w = lambda n: t[pre + n]  # noqa: E731
    rms = lambda x, wt: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * wt  # noqa: E731
    lim = cfg.swiglu_limit
    swiglu = lambda x, g, u, d: (F.silu((x @ g.T).clamp(max=lim)) * (x @ u.T).clamp(-lim, lim)) @ d.T  # noqa: E731
    N, H, dn, dv, P, di, hi = (tokens_next.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                               cfg.index_kpool, cfg.index_head_dim, cfg.index_n_heads)
    e = t[layout.PREFIX + "embed_tokens.weight"][tokens_next].clone()
    e[0] = 0.0  # row 0 has no embedding
    x = torch.cat([rms(e, w("enorm.weight")), rms(hiddens, w("hnorm.weight"))], -1) @ w("eh_proj.weight").T
    a = rms(x, w("input_layernorm.weight"))
    cq = rms(a @ w("self_attn.q_a_proj.weight").T, w("self_attn.q_a_layernorm.weight"))
    q = (cq @ w("self_attn.q_b_proj.weight").T).view(N, H, dn)
    c = rms(a @ w("self_attn.kv_a_proj_with_mqa.weight").T, w("self_attn.kv_a_layernorm.weight"))
    kv = (c @ w("self_attn.kv_b_proj.weight").T).view(N, H, dn + dv)
    K, V = kv[..., :dn], kv[..., dn:]
    kap = F.layer_norm(a @ w("self_attn.indexer.wk.weight").T, (di,), w("self_attn.indexer.k_norm.weight"),
                       w("self_attn.indexer.k_norm.bias"), 1e-6)
    gam = a @ w("self_attn.indexer.index_kpool_compress_gate").T
    ape = w("self_attn.indexer.index_kpool_compress_ape")
    pooled = [(torch.softmax(gam[p * P:p * P + P] + ape, 0) * kap[p * P:p * P + P]).sum(0) for p in range(N // P)]
    qi = (cq @ w("self_attn.indexer.wq_b.weight").T).view(N, hi, di)
    hw = (a @ w("self_attn.indexer.weights_proj.weight").T) * hi ** -0.5
    rows = []
    for s in range(N):
        vis = (s + 1) // P
        keys = set(range(P * vis, s + 1))  # the incomplete tail pool, always
        if vis:
            sc = torch.stack([(hw[s] * F.relu(qi[s] @ pooled[p] / di ** 0.5)).sum() for p in range(vis)])
            for p in sc.topk(min(cfg.index_topk // P, vis)).indices.tolist():
                keys |= set(range(p * P, p * P + P))
        idx = sorted(keys)
        att = torch.softmax(torch.einsum("hd,lhd->hl", q[s], K[idx]) / dn ** 0.5, -1)
        rows.append(torch.einsum("hl,lhd->hd", att, V[idx]).reshape(-1) @ w("self_attn.o_proj.weight").T)
    x = x + torch.stack(rows)
    m = rms(x, w("post_attention_layernorm.weight"))
    scores = torch.sigmoid(m @ w("mlp.gate.weight").T)
    ids = (scores + w("mlp.gate.e_score_correction_bias")).topk(cfg.num_experts_per_tok).indices
    wts = scores.gather(1, ids)
    wts = wts / wts.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    y = swiglu(m, w("mlp.shared_experts.gate_proj.weight"), w("mlp.shared_experts.up_proj.weight"),
               w("mlp.shared_experts.down_proj.weight"))
    for n in range(N):
        for j in range(ids.shape[1]):
            ex = f"mlp.experts.{int(ids[n, j])}."
            y[n] += wts[n, j] * swiglu(m[n], w(ex + "gate_proj.weight"), w(ex + "up_proj.weight"), w(ex + "down_proj.weight"))
    g = rms(x + y, w("shared_head.norm.weight"))
    return g @ t[layout.LM_HEAD].T


def test_mtp_drafts_match_plain_math(ckpt):
    folder, cfg, target, mtp = ckpt
    toks = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(7))
    logits, hidden = target(toks)
    nxt = logits[-1].argmax()
    # rows 0..28 from the prompt, row 29 = (next token, h[29]) proposes draft 1; row 30 chains with g
    slot = mtp.new_state(40)
    mtp.prefill(toks, hidden, slot, target.embed_tokens, target.lm_head)
    assert slot.length == 29
    chain = mtp.propose(nxt, hidden[-1], slot, 3, target.embed_tokens, target.lm_head, share_topk=False)
    assert slot.length == 30  # the real row stays, chain rows are rolled back
    t = checkpoint_tensors(folder)
    rows_next = torch.cat([toks[1:], nxt.reshape(1), chain.tokens[:1]])
    rows_h = torch.cat([hidden, chain.hidden[:1]])
    # no exact tie at the MTP indexer's pool top-k boundary for these rows
    _, _, pend = mtp.forward_rows(rows_next, rows_h, mtp.new_state(40), target.embed_tokens, target.lm_head)
    visible = (torch.arange(31) + 1) // cfg.index_kpool
    assert (visible > cfg.index_topk // cfg.index_kpool).any()
    assert not boundary_ties(pend.scores, visible, cfg.index_topk // cfg.index_kpool, 1e-6 * pend.scores.abs().max()).any()
    ref = reference_mtp(t, cfg, rows_next, rows_h)
    scale = ref.abs().max()
    assert ((chain.logits[0] - ref[29]).abs().max() / scale) < 1e-4   # first-step draft
    assert ((chain.logits[1] - ref[30]).abs().max() / scale) < 1e-4   # chained with the post-norm g
    assert chain.tokens[0] == chain.logits[0].argmax()


def test_chain_rollback_and_shared_topk(ckpt):
    _, cfg, target, mtp = ckpt
    toks = torch.randint(2, 256, (26,), generator=torch.Generator().manual_seed(8))
    _, hidden = target(toks)
    a, b = mtp.new_state(40), mtp.new_state(40)
    for s in (a, b):
        mtp.prefill(toks[:-1], hidden[:-1], s, target.embed_tokens, target.lm_head)
    chain = mtp.propose(toks[-1], hidden[-2], a, 4, target.embed_tokens, target.lm_head)
    mtp.catchup(toks[-1:], hidden[-2:-1], b, target.embed_tokens, target.lm_head)
    n, P = a.length, a.pool
    assert n == b.length == 25
    assert torch.equal(a.tail[: n % P], b.tail[: n % P]) and torch.equal(a.latent[:n], b.latent[:n])
    # index_share_for_mtp_iteration: step 0 scores its own pools, later steps reuse that selection
    c = mtp.new_state(40)
    mtp.prefill(toks[:-1], hidden[:-1], c, target.embed_tokens, target.lm_head)
    shared = mtp.propose(toks[-1], hidden[-2], c, 4, target.embed_tokens, target.lm_head, share_topk=True)
    torch.testing.assert_close(shared.logits[0], chain.logits[0])
    assert shared.tokens.shape == (4,) and c.length == 25


def _copy(folder, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def test_visual_tensors_are_never_read(ckpt):
    folder, cfg, _, _ = ckpt
    assert any(layout.is_visual(n) for n in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    cfg, reader = open_checkpoint(folder)
    seen = []
    orig = reader.get
    reader.get = lambda name, *a, **k: (seen.append(name), orig(name, *a, **k))[1]
    load_target(cfg, reader, torch.float32)
    load_mtp(cfg, reader, torch.float32)
    assert seen and not any(layout.is_visual(n) for n in seen)
    assert set(seen) == set(layout.checkpoint_shapes(cfg))


def test_missing_mtp_layer(ckpt, tmp_path):
    dst = _copy(ckpt[0], tmp_path)
    index = dst / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"] = {k: v for k, v in raw["weight_map"].items() if v != MTP_SHARD}
    index.write_text(json.dumps(raw))
    (dst / MTP_SHARD).unlink()
    with pytest.raises(UserError, match="no MTP layer"):
        load_next(dst, torch.float32)
    load_next(dst, torch.float32, mtp=False)  # the target alone still loads


@pytest.mark.parametrize("damage, match", [
    ("truncate", "unreadable|corrupt"),
    ("delete", "missing"),
    ("reshape", "has shape"),
])
def test_bad_shards_are_one_line_errors(ckpt, tmp_path, damage, match):
    dst = _copy(ckpt[0], tmp_path)
    shard = dst / MTP_SHARD
    if damage == "truncate":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        shard.unlink()
    else:
        with safe_open(str(shard), "pt") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
        key = layout.layer_prefix(ckpt[1].mtp_layer_index) + "eh_proj.weight"
        t[key] = t[key][:, :-1].contiguous()
        save_file(t, shard)
    with pytest.raises(UserError, match=match) as e:
        load_next(dst, torch.float32)
    assert "\n" not in str(e.value)
