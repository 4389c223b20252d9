"""Token choice shared by target and drafter: greedy, temperature, top-p; and speculative acceptance.

Sampling draws without a host sync (argmax of probs / Exponential(1), as gpt-fast does), from an
explicit torch.Generator so a seed reproduces a run. The engine gives each request its own stream
(request_stream: seeded from --seed and the request id) and a batched draw takes row b's noise from
row b's stream, so what a request samples does not depend on which requests share its batch.
"""

from __future__ import annotations

import hashlib

import torch

from glm5mtp_cli.engine.config import SamplingParams  # noqa: F401  (where the engine's callers find it)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: softmax(logits / T), restricted to the top-p nucleus."""
    probs = (logits.float() / params.temperature).softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def request_stream(seed: int, request_id: int, device: torch.device | str) -> torch.Generator:
    """A request's own random stream: the same (seed, request id) gives the same draws. The pair
    is hashed to 32 bits: the CPU generator (mt19937) keeps only a seed's low 32 bits."""
    mixed = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=4).digest()
    return torch.Generator(device=torch.device(device)).manual_seed(int.from_bytes(mixed, "little"))


def draw(probs: torch.Tensor, gens) -> torch.Tensor:
    """One token per row of probs [B, V], without a host sync; gens: one generator per row (row b's
    noise comes from gens[b] alone, so a request's draws do not depend on its batch)."""
    noise = torch.stack([torch.empty_like(probs[b]).exponential_(1.0, generator=g) for b, g in enumerate(gens)])
    return (probs / noise).argmax(-1)


def choose(logits: torch.Tensor, params: SamplingParams, gens):
    """(tokens, probs or None): argmax when greedy, else a draw from probs_from_logits (gens as draw's)."""
    if params.greedy:
        return logits.argmax(-1), None
    probs = probs_from_logits(logits, params)
    return draw(probs, gens), probs


def accept_rejection(drafts: torch.Tensor, draft_probs: torch.Tensor, target_logits: torch.Tensor,
                     num_drafts: int, params: SamplingParams, gen: torch.Generator):
    """Speculative sampling (Leviathan et al.): the emitted tokens follow the target's distribution.

    Draft i is kept with probability min(1, p(d)/q(d)); at the first rejection the token is drawn
    from normalise(max(p - q, 0)); when every draft passes, the bonus token is drawn from p.
    """
    p = probs_from_logits(target_logits, params)  # [g+1, V]
    if num_drafts:
        idx = torch.arange(num_drafts, device=p.device)
        d = drafts[:num_drafts]
        p_d = p[idx, d]
        q_d = draft_probs[idx, d]
        u = torch.rand(num_drafts, generator=gen, device=p.device)
        # u < p/q without dividing by a zero q; a draft of zero target probability (masked by a grammar) never passes
        ok = ((u * q_d <= p_d) & (p_d > 0)).int()
        accepted = int(ok.cumprod(0).sum().item())
    else:
        accepted = 0
    if accepted < num_drafts:
        residual = (p[accepted] - draft_probs[accepted]).clamp_min(0.0)
        total = residual.sum()
        # p == q exactly leaves no residual mass; p itself is then the right distribution.
        residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p[accepted])
        token = draw(residual[None], [gen])[0]
    else:
        token = draw(p[accepted][None], [gen])[0]
    return accepted, int(token.item())
