"""`plan`'s model: what the MTP drafter buys on given hardware, from the config alone (no weights).

Every forward is costed from what it moves and runs, on one of --tp ranks:

- bytes: sizing.draft_step_bytes / target_step_bytes (the batch-1 reads: active weights, KV / indexer /
  KDA state at the context), with the routed experts (sizing.routed_expert_bytes) scaled to the
  experts a batch touches (sizing.batch_step_bytes, which bench's batched steps read too): N tokens routed top-k of E uniformly touch E * (1 - (1 - k/E)^N) distinct
  experts (k at N = 1, so batch 1 is sizing's number exactly); where the few-pair MoE kernels run
  (kernels/moe.py, up to 2E pairs: a 32-token GLM-5 verify), they stream an expert once per (token,
  expert) pair, and the repeats beyond the distinct experts (sizing.reread_experts_factor) are
  priced as first reads for the calibration's `reread_fraction` of them (the rest: L2 hits); the
  state reads once per row of a
  decode, verify or draft (each query selects its own keys; the KDA replay steps its state row by
  row), once per sequence in a prefill chunk (its tiles read the cached prefix once);
- FLOPs: 2 x active parameters (info.active_params, embeddings left out: a lookup) x tokens; the
  attention's own score FLOPs are left out (a few % at decode, more in a long prefill);
- communication at tp > 1: two all-reduces of the hidden rows per layer (attention and MLP/MoE
  outputs) and one more for the vocabulary-parallel embedding and head (costed as one hidden-row
  all-reduce), a ring's 2(tp-1)/tp of the bytes over the link plus the link's latency each;
- launch: kernels (the family's per-layer and draft counts, measured with the calibration) x per-kernel cost;
- host: the call of each forward (a graph replay), and the engine's bookkeeping per step and per
  sequence, charged to the verify (decode) forward.

A forward takes max(bandwidth, compute) + communication + launch + host; its bound is the largest
term. Bandwidth is achieved at the calibrated fraction of the datasheet's for that kind of step
(plan_calibration_h100.json, `plan --calibrate`). A step with gamma drafts over B sequences takes
gamma drafts (the first a catch-up of gamma + 1 rows a sequence) + one verify of gamma + 1 rows; it decodes B * E(gamma) tokens (recommend's model, the
project's one speedup model). TTFT: the batch's prompts (--context tokens each) prefilled in chunks,
plus the drafter's catch-up over them when gamma > 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glm5mtp_cli.diagnostics.calibration import Calibration
from glm5mtp_cli.diagnostics.hardware import Hardware
from glm5mtp_cli.diagnostics.recommend import best_gamma, decode_tokens_per_s, rates_for

BF16 = 2
PREFILL_CHUNK = 1024  # rows of one prompt per prefill forward (EngineConfig.prefill_chunk)
BLOCK_SIZE = 16  # tokens per cache block (the engine's default)
DRAFTER = ("draft", "catchup")  # the MTP layer's forwards: a chained draft, a catch-up over prompt rows
TERMS = ("bandwidth", "compute", "communication", "launch", "host")
SEARCH_LIMIT = 4096  # the largest batch size break_even_batch tries
UNVALIDATED = ("tp > 1: not validated on hardware here (no multi-GPU machine is lent; the 8-GPU figures are "
               "checked against published numbers only)")


@dataclass(frozen=True)
class PlanConfig:
    """Everything `plan` was asked, validated by the command."""

    model: str
    layers: int | None
    fp8: bool
    draft_vocab: int | None
    acceptance: tuple[float, ...]  # conditional: a_k = P(draft k kept | drafts 1..k-1 kept)
    acceptance_source: str
    hardware: Hardware
    calibration: Calibration
    tp: int
    context: int  # cached tokens a decode step reads at
    budget: int  # tokens per request, for the per-sequence state
    batch_sizes: tuple[int, ...]
    gammas: tuple[int, ...]


@dataclass(frozen=True)
class ModelSizes:
    """What one rank of the model reads and computes per forward, from sizing (batch-1 reads)."""

    family: str  # model_type: the key of the calibration's kernel counts
    layers: int
    hidden: int
    vocab: int
    experts: int
    top_k: int
    target_bytes: dict  # sizing.target_step_bytes
    draft_bytes: dict  # sizing.draft_step_bytes
    routed: dict  # sizing.routed_expert_bytes: 'target', 'mtp'
    target_params: int  # active parameters per token, embeddings left out
    draft_params: int  # the MTP layer's, plus its head rows
    weights_bytes: int  # held on one rank, MTP layer included
    state_bytes: int  # one sequence's state at --budget on one rank


@dataclass(frozen=True)
class Forward:
    """One forward's cost: what it moves and the time of each term (seconds)."""

    kind: str  # draft, verify, decode, prefill, catchup
    rows: int  # tokens it runs (all sequences)
    bytes: float
    flops: float
    comm_bytes: float
    kernels: float
    times: dict  # term -> seconds
    reread_bytes: float = 0.0  # routed experts streamed again per pair (sizing.reread_experts_factor)

    @property
    def seconds(self) -> float:
        t = self.times
        return max(t["bandwidth"], t["compute"]) + t["communication"] + t["launch"] + t["host"]

    @property
    def bound(self) -> str:
        return max(TERMS, key=self.times.__getitem__)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "bytes": self.bytes, "reread_bytes": self.reread_bytes,
                "flops": self.flops,
                "comm_bytes": self.comm_bytes, "kernels": self.kernels, "ms": self.seconds * 1e3,
                "bound": self.bound, "terms_ms": {k: v * 1e3 for k, v in self.times.items()}}


def model_sizes(cfg, c: PlanConfig) -> ModelSizes:
    """cfg (already --layers / --fp8) sized by diagnostics/sizing and info: the one place plan asks."""
    import torch

    from glm5mtp_cli.diagnostics import sizing
    from glm5mtp_cli.diagnostics.info import active_params, model_info

    info = model_info(cfg)
    no_embed = lambda parts: {k: v for k, v in parts.items() if k != "embeddings"}  # noqa: E731
    head_rows = c.draft_vocab or cfg.vocab_size
    state = sizing.state_bytes(cfg, torch.bfloat16, c.budget + max(c.gammas), BLOCK_SIZE, with_drafter=True, tp=c.tp)
    return ModelSizes(
        family=cfg.model_type, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, vocab=cfg.vocab_size,
        experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
        target_bytes=sizing.target_step_bytes(cfg, BF16, c.context, c.tp),
        draft_bytes=sizing.draft_step_bytes(cfg, BF16, c.context, c.draft_vocab, c.tp),
        routed=sizing.routed_expert_bytes(cfg, BF16, c.tp),
        target_params=active_params(cfg, no_embed(info.target)),
        draft_params=active_params(cfg, no_embed(info.mtp)) + head_rows * cfg.hidden_size,
        weights_bytes=sizing.predicted_weight_bytes(cfg, torch.bfloat16, with_mtp=True, tp=c.tp),
        state_bytes=sum(state.values()))


def forward_bytes(step_bytes: dict, routed: int, tokens: int, state_reads: int, s: ModelSizes) -> float:
    """One forward of `tokens` rows in all (sizing.batch_step_bytes: the one model of a batch's reads)."""
    from glm5mtp_cli.diagnostics.sizing import batch_step_bytes

    return batch_step_bytes(step_bytes, routed, tokens, state_reads, s.experts, s.top_k)


def _comm(tokens: int, layers: int, s: ModelSizes, c: PlanConfig) -> tuple[float, float]:
    """(bytes, seconds) of the all-reduces one forward runs at tp: 2 per layer + 1 (module docstring)."""
    if c.tp == 1:
        return 0.0, 0.0
    hw = c.hardware
    collectives = 2 * layers + 1
    per = tokens * s.hidden * BF16
    moved = collectives * per * 2 * (c.tp - 1) / c.tp
    return collectives * per, collectives * hw.link_latency_s + moved / hw.link_bytes_per_s


def _launch_s(c: PlanConfig) -> float:
    """A kernel's cost: the hardware's when given (--hardware-file), else the calibration's."""
    return c.calibration.per_kernel_s if c.hardware.launch_s is None else c.hardware.launch_s


def forward(kind: str, seqs: int, rows: int, s: ModelSizes, c: PlanConfig) -> Forward:
    """One forward of `kind` over `seqs` sequences of `rows` rows each."""
    hw, cal = c.hardware, c.calibration
    tokens = seqs * rows
    reads = seqs if kind in ("prefill", "catchup") else tokens
    kernels = cal.kernels_for(s.family)
    from glm5mtp_cli.diagnostics.sizing import reread_experts_factor

    reread = reread_experts_factor(tokens, s.experts, s.top_k)
    if kind in DRAFTER:
        nbytes = forward_bytes(s.draft_bytes, s.routed["mtp"], tokens, reads, s)
        reread *= s.routed["mtp"]
        flops = 2.0 * s.draft_params * tokens
        n_kernels, layers = kernels["draft"], 1
    else:
        nbytes = forward_bytes(s.target_bytes, s.routed["target"], tokens, reads, s)
        reread *= s.routed["target"]
        flops = 2.0 * s.target_params * tokens
        n_kernels, layers = kernels["target_per_layer"] * s.layers, s.layers
    peak = hw.fp8_flops if c.fp8 else hw.bf16_flops
    comm_bytes, comm_s = _comm(tokens, layers, s, c)
    host = cal.host_forward_s
    if kind in ("verify", "decode"):
        host += cal.host_step_s + seqs * cal.host_sequence_s
    elif kind == "draft":
        host += seqs * cal.draft_sequence_s
    times = {"bandwidth": (nbytes + cal.reread_fraction * reread) / (hw.memory_bytes_per_s * cal.efficiency(kind, c.fp8)),
             "compute": flops / (peak * cal.compute_efficiency),
             "communication": comm_s, "launch": n_kernels * _launch_s(c), "host": host}
    return Forward(kind, tokens, nbytes, flops, comm_bytes, n_kernels, times, reread)


def step_seconds(seqs: int, gamma: int, s: ModelSizes, c: PlanConfig) -> float:
    """One decode step (a decode at gamma 0): gamma drafts, the first of them a catch-up over
    gamma + 1 rows per sequence (the engine's catch-up forward is as wide as its largest gamma's,
    the rows the last verify accepted plus padding), then a verify of gamma + 1 rows."""
    return sum(f.seconds * n for f, n in step_forwards(seqs, gamma, s, c))


def step_forwards(seqs: int, gamma: int, s: ModelSizes, c: PlanConfig) -> list[tuple[Forward, int]]:
    """The forwards of step_seconds' step, each with the times it runs."""
    if gamma == 0:
        return [(forward("decode", seqs, 1, s, c), 1)]
    out = [(forward("draft", seqs, gamma + 1, s, c), 1)]
    if gamma > 1:
        out.append((forward("draft", seqs, 1, s, c), gamma - 1))
    return out + [(forward("verify", seqs, gamma + 1, s, c), 1)]


def ttft_seconds(seqs: int, gamma: int, s: ModelSizes, c: PlanConfig) -> float:
    """The batch's prompts prefilled in chunks of PREFILL_CHUNK rows each (a shared forward per chunk;
    the last one's logits give the first token), and the drafter's catch-up over the same rows when
    gamma > 0."""
    chunks = math.ceil(c.context / PREFILL_CHUNK)
    last = c.context - (chunks - 1) * PREFILL_CHUNK
    total = 0.0
    for rows in [PREFILL_CHUNK] * (chunks - 1) + [last]:
        total += forward("prefill", seqs, rows, s, c).seconds
        if gamma > 0:
            total += forward("catchup", seqs, rows, s, c).seconds
    return total


def batch_row(seqs: int, s: ModelSizes, c: PlanConfig) -> dict:
    """One batch size: each gamma's step, TPOT, tokens/s, TTFT and speedup over gamma 0, and the best."""
    base = step_seconds(seqs, 0, s, c)
    base_tps = decode_tokens_per_s([], 0, base, seqs)
    gammas = []
    for g in c.gammas:
        step = step_seconds(seqs, g, s, c)
        tps = decode_tokens_per_s(rates_for(c.acceptance, g), g, step, seqs)
        gammas.append({"gamma": g, "step_ms": step * 1e3, "tpot_ms": seqs / tps * 1e3, "tokens_per_s": tps,
                       "speedup": tps / base_tps, "ttft_ms": ttft_seconds(seqs, g, s, c) * 1e3})
    best = gammas[best_gamma([r["tokens_per_s"] for r in gammas])]
    return {"batch_size": seqs, "best_gamma": best["gamma"], "gammas": gammas}


def break_even_batch(s: ModelSizes, c: PlanConfig, limit: int) -> int | None:
    """The smallest batch size (powers of two below `limit`, then `limit`) at which no gamma > 0 beats
    gamma 0 (None: speculation pays at each): the concurrency above which it stops paying. `limit`
    is what fits in memory (at most SEARCH_LIMIT): a larger batch would be no deployment."""
    drafting = [g for g in c.gammas if g > 0] or [1]
    probes = [b for b in (2**i for i in range(SEARCH_LIMIT.bit_length())) if b < limit] + ([limit] if limit else [])
    for b in probes:
        base = decode_tokens_per_s([], 0, step_seconds(b, 0, s, c), b)
        if all(decode_tokens_per_s(rates_for(c.acceptance, g), g, step_seconds(b, g, s, c), b) <= base
               for g in drafting):
            return b
    return None


def search_limit(memory: dict) -> int:
    """The largest batch break_even_batch may name: the sequences that fit per GPU, at most SEARCH_LIMIT."""
    fits = memory["sequences_per_gpu"]
    return SEARCH_LIMIT if fits is None else min(fits, SEARCH_LIMIT)


def steps_doc(s: ModelSizes, c: PlanConfig) -> dict:
    """The four forwards at batch 1 and the largest batch, at the largest gamma, each with its bound."""
    g = max(c.gammas) or 1
    out = {}
    for seqs in sorted({1, max(c.batch_sizes)}):
        out[str(seqs)] = [forward("draft", seqs, 1, s, c).as_dict(),
                          forward("verify", seqs, g + 1, s, c).as_dict(),
                          forward("decode", seqs, 1, s, c).as_dict(),
                          forward("prefill", seqs, min(PREFILL_CHUNK, c.context), s, c).as_dict()]
    return out


def memory_doc(s: ModelSizes, c: PlanConfig) -> dict:
    free = c.hardware.memory_bytes - s.weights_bytes
    return {"weights_per_gpu_bytes": s.weights_bytes, "state_per_sequence_bytes": s.state_bytes,
            "budget": c.budget, "gpu_memory_bytes": c.hardware.memory_bytes,
            "sequences_per_gpu": max(0, int(free // s.state_bytes)) if s.state_bytes else None}


def notes(c: PlanConfig, fits: int | None) -> list[str]:
    """What the prediction is not: measured at this tp, or on this hardware, or within one GPU's memory."""
    out = [UNVALIDATED] if c.tp > 1 else []
    if c.hardware.name != c.calibration.hardware:
        out.append(f"{c.hardware.name}: datasheet figures scaled by the {c.calibration.hardware}'s measured "
                   "efficiencies, not measured on it")
    past = [b for b in c.batch_sizes if fits is not None and b > fits]
    if past:
        out.append(f"batch {', '.join(map(str, past))}: past the {fits} sequences that fit per GPU at --budget "
                   f"{c.budget}, so no deployment runs it; its rows assume memory the GPU does not have")
    return out


def run_plan(cfg, c: PlanConfig) -> dict:
    """The plan document: per batch size and gamma, the four forwards, memory, the break-even
    concurrency within what fits (the command adds exports and prints it)."""
    s = model_sizes(cfg, c)
    cal = c.calibration
    memory = memory_doc(s, c)
    limit = search_limit(memory)
    return {
        "model": c.model, "family": s.family, "layers": s.layers, "fp8": c.fp8, "draft_vocab": c.draft_vocab,
        "hardware": {"name": c.hardware.name, "sources": c.hardware.sources,
                     **{k: getattr(c.hardware, k) for k in ("memory_bytes_per_s", "bf16_flops", "fp8_flops",
                                                           "memory_bytes", "link_bytes_per_s", "link_latency_s",
                                                           "launch_s")}},
        "tp": c.tp, "validated": c.tp == 1 and c.hardware.name == cal.hardware,
        "notes": notes(c, memory["sequences_per_gpu"]),
        "context": c.context, "acceptance": {"conditional": list(c.acceptance), "source": c.acceptance_source},
        "calibration": cal.summary(),
        "batches": [batch_row(b, s, c) for b in c.batch_sizes],
        "speculation_stops_paying_at_batch": break_even_batch(s, c, limit),
        "break_even_searched_up_to_batch": limit,
        "steps": steps_doc(s, c),
        "memory": memory,
    }
