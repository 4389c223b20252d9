"""profile: per-sequence memory by component and latency per phase, over --max-seq-len values and the
two allocation policies (ceiling: state sized to --max-seq-len; budget: sized to the request).

Predicted numbers come from the config alone (diagnostics/sizing.py: the family's state components x
tokens rounded up to whole blocks), measured ones from the pools' ledger after allocating one sequence exactly as SpecEngine
does, plus the CUDA allocator's delta of creating those pools. Latency at a context of L tokens is
measured without prefilling L tokens: the pools' rows 0..L-1 are filled with random values and the
caches' lengths set to L, then propose and verify run through the engine's public pieces.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.diagnostics.sizing import bytes_per_token, growth_bytes, predicted_bytes, predicted_weight_bytes
from glm5mtp_cli.engine import drafting
from glm5mtp_cli.engine.config import EngineConfig, check_seed
from glm5mtp_cli.engine.proposer import Feed
from glm5mtp_cli.engine.runtime import Runtime, make_engine
from glm5mtp_cli.engine.sequence import Request, reserve_tokens

POLICIES = ("ceiling", "budget")
PREFILL_TOKENS = 32  # the "short prompt" of the prefill latency


@dataclass
class ProfileConfig:
    max_seq_lens: list[int]
    budget: int = 2048
    gamma: int = 3
    block_size: int = 16
    gpu_mem: int = 141 * 10**9
    repeats: int = 5
    seed: int = 0

    def __post_init__(self):
        check_seed(self.seed)


def parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            n = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise UserError(f"--max-seq-len: {part!r} is not an integer (give e.g. 4096,32768,131072)") from None
        if n <= 0:
            raise UserError(f"--max-seq-len values must be positive, got {n}")
        out.append(n)
    if not out:
        raise UserError("--max-seq-len: no lengths given")
    return out


def check_flags(c: ProfileConfig, max_position: int | None = None) -> None:
    if not 0 <= c.gamma <= 16:
        raise UserError(f"--gamma must be in 0..16, got {c.gamma}")
    if c.budget < 2:
        raise UserError(f"--budget must be >= 2 tokens (a prompt token and a new one), got {c.budget}")
    if c.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {c.block_size}")
    if c.repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {c.repeats}")
    for L in c.max_seq_lens:
        need = c.budget + c.gamma
        if need > L:
            # Refused, not clamped: the engine refuses such a request, so a row for it would describe nothing.
            raise UserError(f"--budget {c.budget} + gamma {c.gamma} = {need} rows is over --max-seq-len {L}: "
                            f"refused (the engine would refuse that request); lower --budget or drop {L}")
        if max_position is not None and L > max_position:
            raise UserError(f"--max-seq-len {L} is over the model's limit (max_position_embeddings {max_position})")


def policy_tokens(c: ProfileConfig, policy: str, max_seq_len: int) -> int:
    """Rows reserved per cache for a request of c.budget tokens (prompt + new) under a policy."""
    return reserve_tokens(1, c.budget - 1, c.gamma, policy, max_seq_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_state(rt: Runtime, c: ProfileConfig, policy: str, max_seq_len: int) -> dict:
    """Pools for one sequence, then the engine admits one request of the budget (a one-token
    prompt): what its target cache and drafter state hold is what the pools' ledger reads."""
    dev = rt.device
    tokens = policy_tokens(c, policy, max_seq_len)
    _sync(dev)
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    pools = CachePools.create(rt.cfg, math.ceil(tokens / c.block_size), c.block_size, rt.dtype, dev,
                              with_drafter=rt.mtp is not None and c.gamma > 0, tp=rt.tp)
    _sync(dev)
    cuda_delta = torch.cuda.memory_allocated(dev) - before if before is not None else None
    engine = make_engine(rt, pools, EngineConfig(gamma=c.gamma, max_seq_len=max_seq_len, alloc=policy, eos_ids=(),
                                                 graphs="eager"))
    seq = engine.admission.start(Request([0], c.budget - 1))
    try:
        held = pools.bytes_held()
    finally:
        engine.lifecycle.release(seq)
    out = {c.name: held.get(c.name, 0) for c in family_of(rt.cfg).state_components(rt.cfg, rt.dtype)}
    out["total"] = sum(out.values())
    if cuda_delta is not None:
        out["cuda_pool_allocation"] = cuda_delta
    del engine, pools
    return out


def _median_time(fn, reset, device: torch.device, repeats: int) -> float:
    fn()
    reset()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        reset()
    return statistics.median(times) * 1e3


def measure_latency(rt: Runtime, c: ProfileConfig, context: int) -> dict:
    """Median ms per phase at `context` cached rows, with the caches filled by random rows."""
    dev, cfg, g = rt.device, rt.cfg, c.gamma
    extra = max(PREFILL_TOKENS, g + 1)
    rows = context + extra
    pools = CachePools.create(cfg, math.ceil(rows / c.block_size), c.block_size, rt.dtype, dev,
                              with_drafter=rt.mtp is not None and g > 0, tp=rt.tp)
    gen = torch.Generator(device=dev).manual_seed(c.seed)
    for pool in pools.pools.values():  # random rows, one layer at a time (no temporary copies)
        for layer in range(pool.num_layers):
            pool.data[layer].normal_(generator=gen)
    engine = make_engine(rt, pools, EngineConfig(gamma=g, max_seq_len=rows, graphs="eager"))
    cache = pools.target_cache()
    cache.reserve(rows)
    cache.length = context
    state = engine.head.alloc_state_for(rows) if engine.head is not None else None
    if state is not None:
        state.cache.length = context
        state.real_rows = context

    def reset():
        cache.truncate(context)
        if state is not None:
            state.cache.truncate(context)
            state.real_rows = context
            state.last_drafts = None

    vocab = cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, PREFILL_TOKENS), device=dev, generator=gen)
    last = torch.randint(0, vocab, (1,), device=dev, generator=gen)
    hidden = torch.randn(1, cfg.hidden_size, device=dev, generator=gen).to(rt.dtype)
    ids = torch.randint(0, vocab, (1, g + 1), device=dev, generator=gen)

    def prefill():
        rt.target(prompt, [cache], rows="last")

    def propose():
        return drafting.propose(engine.head, engine.runner, Feed(last[None], hidden[None], [1]), [state], g,
                                engine.config.draft_conf_tau)

    def verify():
        return rt.target(ids, [cache], rows="all")

    def step():
        chains = propose() if g > 0 else None
        v_ids = torch.cat([last[:, None], chains[0].tokens[None]], 1) if chains else last[:, None]
        out = rt.target(v_ids, [cache], rows="all")
        out.logits.argmax(-1).tolist()  # the acceptance's host sync

    res = {"context_tokens": context, "prefill_tokens": PREFILL_TOKENS, "verify_tokens": g + 1}
    with torch.no_grad():
        res["prefill_ms"] = _median_time(prefill, reset, dev, c.repeats)
        res["propose_per_draft_ms"] = (_median_time(propose, reset, dev, c.repeats) / g) if g > 0 else None
        if dev.type == "cuda":
            _sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        res["verify_ms"] = _median_time(verify, reset, dev, c.repeats)
        if dev.type == "cuda":
            res["verify_peak_scratch_bytes"] = torch.cuda.max_memory_allocated(dev) - base
        res["step_ms"] = _median_time(step, reset, dev, c.repeats)
    cache.release()
    if state is not None:
        engine.head.free_state(state)
    return res


def run_profile(cfg: ModelConfig, dtype: torch.dtype, c: ProfileConfig, rt: Runtime | None = None,
                progress=None) -> dict:
    """The whole sweep. rt None: predict only (config, no weights)."""
    with_mtp = c.gamma > 0 and (rt is None or rt.mtp is not None)
    weights_pred = predicted_weight_bytes(cfg, dtype, with_mtp)
    weights_meas = sum(rt.weight_bytes().values()) if rt is not None else None
    weights = weights_meas if weights_meas is not None else weights_pred
    bpt = bytes_per_token(cfg, dtype, with_drafter=with_mtp)
    rows = []
    for L in c.max_seq_lens:
        lat = None
        if rt is not None:
            lat = measure_latency(rt, c, L)
        for policy in POLICIES:
            tokens = policy_tokens(c, policy, L)
            # scratch at the longest context the sequence can reach under its own policy
            pred = predicted_bytes(cfg, dtype, tokens, c.block_size, c.gamma if with_mtp else 0,
                                   min(tokens, L) - c.gamma - 1, L, tp=rt.tp if rt is not None else 1)
            meas = measure_state(rt, c, policy, L) if rt is not None else None
            per_seq = pred["total"]
            free = c.gpu_mem - weights
            growth = growth_bytes(cfg, dtype, c.gamma, with_mtp)
            rows.append({"max_seq_len": L, "policy": policy, "reserved_tokens": tokens,
                         "per_sequence_bytes": pred, "measured_per_sequence_bytes": meas,
                         "max_concurrent_sequences": max(0, free // per_seq),
                         "growth_per_1k_tokens_bytes": growth, "latency_ms": lat})
            if progress is not None:
                progress()
    return {"model_layers": cfg.num_hidden_layers, "dtype": str(dtype).replace("torch.", ""),
            "budget": c.budget, "gamma": c.gamma, "block_size": c.block_size, "gpu_mem_bytes": c.gpu_mem,
            "bytes_per_token": bpt, "weights_bytes": weights, "weights_bytes_predicted": weights_pred,
            "weights_bytes_measured": weights_meas, "rows": rows,
            "notes": {"scratch": "verify activations of gamma+1 rows at the row's longest context, peak of one "
                                 "layer of the PyTorch path (see sizing.scratch_bytes)",
                      "cuda_graphs": "per batch slot on CUDA: static inputs and the outputs the graphs own "
                                     "(sizing.graph_bytes); their intermediates share the scratch peak",
                      "latency": "context filled with random rows (no prefill of L tokens); prefill = "
                                 f"{PREFILL_TOKENS} tokens appended at that context; medians of --repeats runs",
                      "max_concurrent_sequences": "(gpu_mem - weights) // predicted per-sequence total"}}
