"""The cache-free, differentiable forward of GLM-5-Next over whole windows [B, T] (`glm5mtp train`).

The same math as the inference path (pooled.PooledTarget's forward over empty caches), batched over B
and with no caches, pending rows or @torch.no_grad:

- KDA: the chunked (WY) form of kda.kda_chunked with the B*H heads of the batch as independent heads
  and a zero initial state, its within-chunk part (decay ratios, the triangular solves) computed for
  all chunks at once and only the state carried chunk to chunk (few, large kernels: what a GPU
  step needs); the short conv as one grouped conv1d (fp32, as at inference);
- indexed MLA: the pooled indexer scores every complete pool, each query keeps its top
  index_topk / index_kpool visible pools plus its tail, and attention runs with k/v expanded from
  the latent (the training-friendly order; the absorbed inference form equals it up to rounding);
- mHC weights, the KDA recurrence, indexer scores and softmaxes stay fp32 under bf16 autocast.

Indexer loss (optional, the GLM-5 warm-up loss's analogue): per query, KL from the layer's DENSE
causal attention, summed over heads and aggregated per complete visible pool, to the softmax of the
indexer's pool scores over the same pools. The indexer reads detached inputs when it is asked for,
so the loss trains only the indexer (the selection itself is not differentiable: without the loss
the indexer stays at its initialisation).

`training_init` gives the KDA forget gates a spread of decay rates instead of the generic
initialiser's ~0.08 per token (which makes every KDA layer forget almost at once).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5mtp_cli.models.glm5_next.decoder import Glm5NextForCausalLM, NextBlock
from glm5mtp_cli.models.glm5_next.attention import MlaLayer
from glm5mtp_cli.models.glm5_next.kda import CHUNK, KdaInputs, KdaLayer, prepare_inputs
from glm5mtp_cli.models.glm5_next.mhc import contract_streams, expand_streams, hc_collapse, hc_expand, hc_weights
from glm5mtp_cli.models.glm5_next.mtp import Glm5NextMtpLayer


# Chunk length of the training KDA form. Its within-chunk tensors grow with T * chunk * d per head and
# its sequential loop with T / chunk. Measured here (CPU, one thread, glm5next-nano target fwd+bwd,
# B 2, T 512): chunk 16 1.4 s, 32 1.7 s, 64 4.0 s; 32 keeps the GPU's chunk loop at T/32 launches.
TRAIN_CHUNK = 32


def _fp32(device: torch.device):
    """Autocast off: what inference computes in fp32 stays fp32 in a bf16-autocast training step."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


# ---- KDA ------------------------------------------------------------------------------------------

def kda_chunks_parallel(x: KdaInputs, chunk: int = CHUNK) -> torch.Tensor:
    """kda.kda_chunked from a zero state, x [T, N, d] (N independent heads) -> o [T, N, d] fp32.

    Rows past T pad the last chunk with g = 0, beta = 0, k = 0 (no decay, no write): the state and
    the real rows' outputs are unchanged. Per chunk, with G the cumulative log-decay and
    E[r, s, c] = exp(G_r - G_s)[c] k_s[c] (s <= r, else 0): (K K^T)_decayed = E k_r, Aqk = E q_r.
    """
    T, N, d = x.q.shape
    L = min(chunk, T)
    nc = -(-T // L)
    pad = nc * L - T

    def split(t: torch.Tensor) -> torch.Tensor:  # [T, N, ...] -> [nc, N, L, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad)) if pad else t
        return t.view(nc, L, N, *t.shape[2:]).transpose(1, 2)

    q, k, v, g, beta = (split(t) for t in (x.q, x.k, x.v, x.g, x.beta))    # beta [nc, N, L]
    G = g.cumsum(2)                                                          # [nc, N, L, d]
    tri = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()         # s <= r
    diff = (G.unsqueeze(3) - G.unsqueeze(2)).masked_fill(~tri[:, :, None], float("-inf")).exp()  # [nc,N,r,s,d]
    e = diff * k.unsqueeze(2)                                                # k_s e^{G_r - G_s}
    kk = torch.matmul(e, k.unsqueeze(-1)).squeeze(-1)                        # [nc, N, r, s]
    aqk = torch.matmul(e, q.unsqueeze(-1)).squeeze(-1)
    lmat = (beta.unsqueeze(-1) * kk).tril(-1)
    eye = torch.eye(L, dtype=q.dtype, device=q.device)
    bv = beta.unsqueeze(-1) * v
    bk = beta.unsqueeze(-1) * k * G.exp()
    u = torch.linalg.solve_triangular(eye + lmat, bv, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(eye + lmat, bk, upper=False, unitriangular=True)
    qg = q * G.exp()
    last = G[:, :, -1]                                                       # [nc, N, d]
    kdec = (k * (last.unsqueeze(2) - G).exp()).transpose(-1, -2)             # [nc, N, d, L]
    s = q.new_zeros(N, d, d)
    outs = []
    for c in range(nc):  # only the state crosses chunks
        vp = u[c] - torch.matmul(w[c], s)
        outs.append(torch.matmul(qg[c], s) + torch.matmul(aqk[c], vp))
        s = last[c].exp().unsqueeze(-1) * s + torch.matmul(kdec[c], vp)
    o = torch.stack(outs).transpose(1, 2).reshape(nc * L, N, d)
    return o[:T]


def kda_forward(layer: KdaLayer, a: torch.Tensor, chunk: int = TRAIN_CHUNK) -> torch.Tensor:
    """a [B, T, D] normed block input from position 0 -> y [B, T, D]."""
    B, T, _ = a.shape
    H, d, K = layer.heads, layer.head_dim, layer.kernel
    z = torch.cat([layer.q_proj(a), layer.k_proj(a), layer.v_proj(a)], dim=-1)        # [B, T, 3C]
    with _fp32(a.device):
        w = layer.conv_weight().float().unsqueeze(1)                                   # [3C, 1, K]
        zp = F.pad(z.float().transpose(1, 2), (K - 1, 0))                              # causal: K-1 zeros first
        zc = F.silu(F.conv1d(zp, w, groups=w.shape[0])).transpose(1, 2).to(z.dtype)    # [B, T, 3C]
    q, k, v = (t.reshape(B, T, H, d) for t in zc.chunk(3, dim=-1))
    f = (layer.f_b_proj(layer.f_a_proj(a)).float() + layer.dt_bias.float()).view(B, T, H, d)
    g = layer.lower_bound * torch.sigmoid(layer.A_log.float().exp().view(1, 1, -1, 1) * f)
    beta = torch.sigmoid(layer.b_proj(a))
    with _fp32(a.device):
        x = prepare_inputs(q, k, v, g, beta)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [T, B*H, ...]
            return t.transpose(0, 1).reshape(T, B * H, *t.shape[3:])

        xi = KdaInputs(heads(x.q), heads(x.k), heads(x.v), heads(x.g), heads(x.beta))
        o = kda_chunks_parallel(xi, chunk)
        o = o.view(T, B, H, d).transpose(0, 1)                                        # [B, T, H, d]
        gate = layer.g_b_proj(layer.g_a_proj(a)).view(B, T, H, d).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.eps) * layer.o_norm.weight.float()
        o = o * torch.sigmoid(gate)
    return layer.o_proj(o.to(a.dtype).reshape(B, T, -1))


# ---- indexed MLA ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttendedKeys:
    """What each query row of an MLA window attended: a chained MTP row attends the same (see
    mla_chain_forward). k [B, T, h, dn], v [B, T, h, dv], mask [B, T(query), T(key)] bool."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor


def mla_forward(layer: MlaLayer, a: torch.Tensor, want_indexer_loss: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, AttendedKeys]:
    """a [B, T, D] from position 0 -> (y [B, T, D], indexer KL loss or None, the keys it attended)."""
    B, T, _ = a.shape
    P, h, dn, dv = layer.pool, layer.heads, layer.dn, layer.dv
    idx = layer.indexer
    cq = layer.q_a_layernorm(layer.q_a_proj(a))
    q = layer.q_b_proj(cq).view(B, T, h, dn)
    c = layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(a))                             # [B, T, R]
    k, v = layer.kv_b_proj(c).view(B, T, h, dn + dv).split([dn, dv], dim=-1)

    # pooled indexer over the complete pools [0, m)
    ia, icq = (a.detach(), cq.detach()) if want_indexer_loss else (a, cq)
    m = T // P
    pos = torch.arange(T, device=a.device)
    visible = (pos + 1) // P                                                           # complete pools query s sees
    valid = torch.arange(m, device=a.device)[None, :] < visible[:, None]               # [T, m]
    raw = idx.raw_keys(ia)                                                             # [B, T, 2 di]
    di = idx.head_dim
    with _fp32(a.device):
        grouped = raw[:, : m * P].view(B, m, P, 2 * di)
        keys, gates = grouped[..., :di], grouped[..., di:]
        probs = (gates.float() + idx.index_kpool_compress_ape.float()).softmax(dim=2).to(keys.dtype)
        pooled = (probs * keys).sum(dim=2)                                             # [B, m, di]
        qi = idx.wq_b(icq).view(B, T, idx.heads, di)
        wi = idx.weights_proj(ia.to(idx.weights_proj.weight.dtype)).float() * idx.heads ** -0.5
        s = torch.einsum("bthc,bpc->bthp", qi.float(), pooled.float()) * di ** -0.5
        scores = torch.einsum("bth,bthp->btp", wi, F.relu(s))                          # [B, T, m]
    if m:
        masked = scores.detach().masked_fill(~valid, float("-inf"))
        top = masked.topk(min(idx.n_select, m), dim=-1).indices
        sel = torch.zeros(B, T, m, dtype=torch.bool, device=a.device).scatter_(-1, top, True) & valid
        mask = sel[:, :, (pos // P).clamp(max=m - 1)] & (pos < m * P)[None, None, :]   # [B, T, T]
    else:
        mask = torch.zeros(B, T, T, dtype=torch.bool, device=a.device)
    causal = pos[None, :] <= pos[:, None]                                              # [T, T]
    if idx.always_tail:
        mask = mask | ((pos[None, :] >= ((pos + 1) // P * P)[:, None]) & causal)[None]

    att = torch.einsum("bshd,bthd->bhst", q, k).float() * layer.scale                  # [B, h, T, T]
    p = att.masked_fill(~mask[:, None], float("-inf")).softmax(-1).to(v.dtype)
    o = torch.einsum("bhst,bthd->bshd", p, v).reshape(B, T, h * dv)
    y = layer.o_proj(o)

    loss = None
    if want_indexer_loss:
        with torch.no_grad():
            dense = att.detach().masked_fill(~causal, float("-inf")).softmax(-1).sum(1)  # [B, T, T]
            target = dense[..., : m * P].reshape(B, T, m, P).sum(-1).masked_fill(~valid, 0.0)
            target = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
        if m:  # queries from position P-1 on see at least one complete pool
            logp = scores.masked_fill(~valid, float("-inf")).log_softmax(-1).masked_fill(~valid, 0.0)
            kl = (target * (target.clamp_min(1e-12).log() - logp)).sum(-1)              # [B, T]
            loss = kl[:, P - 1:].mean()
    return y, loss, AttendedKeys(k, v, mask)


def mla_chain_forward(layer: MlaLayer, a: torch.Tensor, first: AttendedKeys) -> torch.Tensor:
    """A chained draft step over a window: row i (position i+1, its pair (g of first-step row i, the
    token after it)) attends exactly the keys first-step row i attended plus its own key, as the
    engine's chain does with the shared top-k (the step-0 selection, its tail and the chain's own
    rows). a [B, T', D] normed, T' <= the first step's T -> y [B, T', D]."""
    B, T, _ = a.shape
    h, dn, dv = layer.heads, layer.dn, layer.dv
    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(a))).view(B, T, h, dn)
    c = layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(a))
    k, v = layer.kv_b_proj(c).view(B, T, h, dn + dv).split([dn, dv], dim=-1)
    k1, v1, mask = first.k[:, :T], first.v[:, :T], first.mask[:, :T, :T]
    att = torch.einsum("bshd,bthd->bhst", q, k1).float() * layer.scale                 # [B, h, T, T]
    att = att.masked_fill(~mask[:, None], float("-inf"))
    own = torch.einsum("bshd,bshd->bhs", q, k).float().unsqueeze(-1) * layer.scale      # [B, h, T, 1]
    p = torch.cat([att, own], dim=-1).softmax(-1).to(v.dtype)
    o = torch.einsum("bhst,bthd->bshd", p[..., :T], v1) + p[..., T].transpose(1, 2).unsqueeze(-1) * v
    return layer.o_proj(o.reshape(B, T, h * dv))


# ---- blocks and models -----------------------------------------------------------------------------

def block_forward(block: NextBlock, streams: torch.Tensor, want_indexer_loss: bool, chunk: int = TRAIN_CHUNK):
    """streams [B, T, n, D] -> (streams, indexer loss or None)."""
    c = block.cfg

    def weights(site: str):
        with _fp32(streams.device):
            return hc_weights(streams, getattr(block, f"hc_{site}_fn"), getattr(block, f"hc_{site}_base"),
                              getattr(block, f"hc_{site}_scale"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)

    pre, post, comb = weights("attn")
    a = block.input_layernorm(hc_collapse(streams, pre))
    loss = None
    if block.kda:
        y = kda_forward(block.self_attn, a, chunk)
    else:
        y, loss, _ = mla_forward(block.self_attn, a, want_indexer_loss)
    streams = hc_expand(streams, y, post, comb)
    pre, post, comb = weights("ffn")
    y = block.mlp(block.post_attention_layernorm(hc_collapse(streams, pre)))
    return hc_expand(streams, y, post, comb), loss


def _sum(losses: list, like: torch.Tensor) -> torch.Tensor:
    losses = [x for x in losses if x is not None]
    return torch.stack(losses).sum() if losses else like.new_zeros((), dtype=torch.float32)


def target_forward(model: Glm5NextForCausalLM, input_ids: torch.Tensor, want_indexer_loss: bool = False,
                   chunk: int = TRAIN_CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (each window from position 0) -> (logits [B, T, V], post-norm hidden
    [B, T, D], summed indexer loss)."""
    streams = expand_streams(model.embed_tokens(input_ids), model.cfg.hc_mult)
    losses = []
    for block in model.layers:
        streams, loss = block_forward(block, streams, want_indexer_loss, chunk)
        losses.append(loss)
    hidden = model.norm(contract_streams(streams))
    return model.lm_head(hidden), hidden, _sum(losses, hidden)


def mtp_forward(layer: Glm5NextMtpLayer, hidden: torch.Tensor, next_ids: torch.Tensor, embed, head,
                want_indexer_loss: bool = False, chain: bool = False):
    """Rows i = (embed(next_ids[:, i]), hidden[:, i]) from position 0 (embedding zeroed at row 0,
    as at inference) -> (draft logits [B, T, V], g [B, T, D], indexer loss, chained logits).

    chain: also the second draft of a chain, teacher-forced: row i pairs g[:, i] with next_ids[:, i+1]
    and predicts the token after it ([B, T-1, V]; None without chain)."""
    e = embed(next_ids)
    e = e.masked_fill((torch.arange(next_ids.shape[1], device=e.device) == 0)[None, :, None], 0.0)
    x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden.to(e.dtype))], dim=-1))
    y, loss, keys = mla_forward(layer.self_attn, layer.input_layernorm(x), want_indexer_loss)
    g = _mtp_tail(layer, x + y)
    chained = None
    if chain:
        x2 = layer.eh_proj(torch.cat([layer.enorm(e[:, 1:]), layer.hnorm(g[:, :-1])], dim=-1))
        chained = head(_mtp_tail(layer, x2 + mla_chain_forward(layer.self_attn, layer.input_layernorm(x2), keys)))
    return head(g), g, _sum([loss], g), chained


def _mtp_tail(layer: Glm5NextMtpLayer, x: torch.Tensor) -> torch.Tensor:
    """The MTP block after its attention's residual: the MoE's residual, then shared_head.norm."""
    return layer.shared_head.norm(x + layer.mlp(layer.post_attention_layernorm(x)))


# ---- initialisation for training -------------------------------------------------------------------

@torch.no_grad()
def training_init(model: torch.nn.Module, seed: int, min_decay: float = 0.01, max_decay: float = 1.0) -> None:
    """Spread each KDA layer's per-channel forget rate -g over [min_decay, max_decay] (log-uniform),
    with A_log = 0: g = lb * sigmoid(f + dt_bias), f ~ 0 at init, so dt_bias = logit(g / lb).
    (Mamba/KDA-style: some channels keep ~100 tokens, some ~1.)"""
    gen = torch.Generator().manual_seed(seed * 7919 + 17)
    for mod in model.modules():
        if isinstance(mod, KdaLayer):
            n = mod.dt_bias.numel()
            u = torch.rand(n, generator=gen)
            rate = torch.exp(math.log(min_decay) + u * (math.log(max_decay) - math.log(min_decay)))
            frac = (rate / -mod.lower_bound).clamp(1e-6, 1 - 1e-6)
            mod.dt_bias.copy_(torch.log(frac) - torch.log1p(-frac))
            mod.A_log.zero_()
