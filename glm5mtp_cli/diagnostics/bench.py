"""bench: glm5mtp at gamma 0..4 beside transformers' `generate` on the same checkpoint, one device.

Every configuration runs once as a warm-up (excluded), then `repeats` times; the tables report
medians. The draft-step floor is the bytes one chained draft step must read at batch 1 (the MTP
layer's non-expert weights, the chosen experts, the lm_head rows drafted over, the indexer keys of
the whole context and the selected latent rows: sizing.draft_step_bytes) over a copy bandwidth
measured in the same run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.draft_vocab import load_draft_ids
from glm5mtp_cli.engine.run import run_generate
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.runtime import Runtime
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.diagnostics.sizing import draft_step_bytes, target_step_bytes
from glm5mtp_cli.checkpoint.load import build_loaded
from glm5mtp_cli.checkpoint.random import RandomReader
from glm5mtp_cli.models import family_of


@dataclass
class BenchConfig:
    gammas: list[int]
    batch_sizes: list[int]
    max_new_tokens: int = 128
    repeats: int = 3
    with_transformers: bool = True
    graphs: str = "eager"  # the engine's forward mode (runtime.graph_mode)
    schedule: str = "continuous"  # speculate.SCHEDULES
    gamma_policy: str = "fixed"  # gamma.POLICIES
    num_prompts: int | None = None  # None: one prompt per slot; else this many through the batch's slots


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _workload(prompts: list[list[int]], batch: int, c: BenchConfig) -> list[list[int]]:
    """The prompts one configuration runs: --num-prompts of them through `batch` slots, else one per slot."""
    return prompts[: c.num_prompts] if c.num_prompts else prompts[:batch]


def run_glm5mtp(rt: Runtime, prompts: list[list[int]], gamma: int, batch: int, c: BenchConfig) -> dict:
    """End to end over the workload (continuous batching through `batch` slots); medians of the
    timed runs, TTFT (queue + prefill) and TPOT percentiles over the requests of the median run."""
    runs = []
    for i in range(c.repeats + 1):
        _, acc, lat, _, _ = run_generate(rt, _workload(prompts, batch, c), gamma=gamma, max_new_tokens=c.max_new_tokens,
                                         sampling=SamplingParams(), batch_size=batch,
                                         max_seq_len=rt.cfg.max_position_embeddings, alloc="budget",
                                         draft_conf_tau=None, ignore_eos=True, graphs=c.graphs,
                                         schedule=c.schedule, gamma_policy=c.gamma_policy)
        if i:  # the first run warms caches, allocator and kernels up
            runs.append((acc, lat))
    med = lambda key: statistics.median(r[1][key] for r in runs)  # noqa: E731
    system = f"gamma {gamma}" + (" adaptive" if gamma and c.gamma_policy == "adaptive" else "") + \
        (f", {c.schedule}" if c.schedule != "continuous" else "")
    return {"system": system, "gamma": gamma, "batch": batch, "graphs": c.graphs, "schedule": c.schedule,
            "gamma_policy": c.gamma_policy,
            "e2e_tokens_per_s": med("e2e_tokens_per_s"), "decode_tokens_per_s": med("decode_tokens_per_s"),
            "tpot_ms_p50": med("tpot_ms_p50"), "tpot_ms_p99": med("tpot_ms_p99"),
            "ttft_ms_p50": med("ttft_ms_p50"), "ttft_ms_p99": med("ttft_ms_p99"),
            "prompts": len(_workload(prompts, batch, c)), "graph_capture_ms": med("graph_capture_ms"),
            "mean_acceptance_length": runs[0][0].mean_acceptance_length if gamma else 1.0,
            "per_position": runs[0][0].per_position}


def run_transformers(rt: Runtime, prompts: list[list[int]], batch: int, c: BenchConfig) -> dict:
    """transformers' greedy generate with GlmMoeDsaForCausalLM (target only) on the same weights."""
    try:
        from transformers import GlmMoeDsaForCausalLM
    except ImportError:
        raise UserError("bench: transformers >= 5.2 is needed for the baseline (pip install 'transformers>=5.2'), "
                        "or pass --no-transformers") from None
    model = GlmMoeDsaForCausalLM.from_pretrained(str(rt.resolved.folder), dtype=rt.dtype).to(rt.device).eval()
    work = _workload(prompts, batch, c)
    pad = rt.cfg.pad_token_id or 0
    groups = []  # static batches of `batch` left-padded prompts (transformers' generate has no slots)
    for g0 in range(0, len(work), batch):
        group = work[g0:g0 + batch]
        width = max(len(p) for p in group)
        groups.append((torch.tensor([[pad] * (width - len(p)) + p for p in group], device=rt.device),
                       torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=rt.device)))
    times = []
    for i in range(c.repeats + 1):
        _sync(rt.device)
        t0 = time.perf_counter()
        new = 0
        for ids, mask in groups:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=c.max_new_tokens,
                                     min_new_tokens=c.max_new_tokens, do_sample=False, pad_token_id=pad)
            new += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        _sync(rt.device)
        if i:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    del model
    return {"system": "transformers", "gamma": None, "batch": batch, "e2e_tokens_per_s": new / t,
            "decode_tokens_per_s": None, "tpot_ms_p50": t / len(groups) / c.max_new_tokens * 1e3,
            "tpot_ms_p99": None, "ttft_ms_p50": None, "ttft_ms_p99": None, "prompts": len(work),
            "mean_acceptance_length": None, "per_position": None}


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        base0 = next((x for x in rows if x["batch"] == r["batch"] and x["gamma"] == 0), None)
        hf = next((x for x in rows if x["batch"] == r["batch"] and x["gamma"] is None), None)
        r["speedup_vs_gamma0"] = r["e2e_tokens_per_s"] / base0["e2e_tokens_per_s"] if base0 else None
        r["speedup_vs_transformers"] = r["e2e_tokens_per_s"] / hf["e2e_tokens_per_s"] if hf else None


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float | None:
    """Device-to-device copy, bytes read + written per second (the memory ceiling)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / statistics.median(times)


def _graph_step_seconds(f, context: int, repeats: int) -> float:
    """Capture a one-row static forward (graphs.StaticForward) appending at row `context` and
    return the median device time of its replays."""
    f.ids.fill_(1)
    f.set_starts([context])
    f.capture(torch.cuda.graph_pool_handle())
    try:
        return _replay_seconds(f.run, repeats)
    finally:
        f.close()


def _replay_seconds(run, repeats: int) -> float:
    """Median device time of one call of `run` (CUDA events around each; after 3 warm-ups)."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _fill_random(pools) -> None:
    for pool in pools.pools.values():
        pool.data.normal_(0, 1)


def time_draft_step(mtp, embed, head, device: torch.device, dtype: torch.dtype, context: int,
                    draft_ids: torch.Tensor | None = None, repeats: int = 20, graphs: bool = True) -> float:
    """Median seconds of one chained draft step (batch 1) at a context of `context` drafter rows.
    On CUDA with `graphs`: the forward captured as a CUDA graph (what the engine replays), timed
    with device events; else host-timed around a synchronised eager forward."""
    from glm5mtp_cli.engine.cache import CachePools
    from glm5mtp_cli.engine.graphs import sequence_forward
    from glm5mtp_cli.engine.mtp_head import MtpHead

    cfg = mtp.cfg
    pools = CachePools.create(cfg, math.ceil((context + 8) / 16), 16, dtype, device)
    head_ = MtpHead(mtp, embed, head, pools, context + 8, draft_ids=draft_ids,
                    carry_normed=cfg.mtp_carry_normed_hidden)
    state = head_.alloc_state_for(context + 8)
    out_head = head_.draft_head or head
    try:
        _fill_random(pools)
        state.cache.length = state.real_rows = context
        hidden = torch.randn(1, cfg.hidden_size, device=device, dtype=dtype)
        token = torch.tensor([1], device=device)
        if graphs and device.type == "cuda":
            f = sequence_forward(head_.context,
                                 lambda f: head_.drafter_forward(f.ids, f.hidden, f.context(f.starts, 1), "last"),
                                 state.cache, 1, device, (cfg.hidden_size, dtype))
            f.hidden.copy_(hidden[None])
            return _graph_step_seconds(f, context, repeats)
        times = []
        for i in range(repeats + 3):
            _sync(device)
            t0 = time.perf_counter()
            mtp(token[None], hidden[None], [state.cache], embed, out_head, rows="last")
            _sync(device)
            state.cache.truncate(context)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        head_.free_state(state)


def time_target_step(target, device: torch.device, dtype: torch.dtype, context: int, repeats: int = 20) -> float:
    """Median device seconds of one batch-1 decode step of `target` at `context` cached rows,
    replayed as a CUDA graph (CUDA only)."""
    from glm5mtp_cli.engine.cache import CachePools
    from glm5mtp_cli.engine.graphs import sequence_forward

    cfg = target.cfg
    pools = CachePools.create(cfg, math.ceil((context + 8) / 16), 16, dtype, device, with_drafter=False)
    cache = pools.target_cache()
    cache.reserve(context + 8)
    try:
        _fill_random(pools)
        f = sequence_forward(target.context, lambda f: target.forward_batch(f.ids, f.context(f.starts, 1), "last"),
                             cache, 1, device)
        return _graph_step_seconds(f, context, repeats)
    finally:
        cache.release()


def random_target(cfg: ModelConfig, layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The target truncated to `layers` layers with random weights (checkpoint.random's initialiser)
    built on the device."""
    family = family_of(cfg)
    reader = RandomReader(cfg, seed)
    return build_loaded(lambda: family.build_target(cfg.with_layers(layers)), reader, "", dtype, device,
                        family.keeps_fp32, what="target").eval()


def random_drafter(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The MTP layer, embeddings and head with random weights (checkpoint.random's initialiser)
    built on the device: real dimensions without a checkpoint on disk (the draft step's time does
    not depend on the values)."""
    from torch import nn

    family = family_of(cfg)
    reader = RandomReader(cfg, seed)
    mtp = build_loaded(lambda: family.build_mtp(cfg), reader, family.mtp_prefix(cfg), dtype, device,
                       family.keeps_fp32, what="MTP layer")
    embed = build_loaded(lambda: nn.Embedding(cfg.vocab_size, cfg.hidden_size), reader, "model.embed_tokens.",
                         dtype, device)
    head = build_loaded(lambda: nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False), reader, "lm_head.",
                        dtype, device)
    return mtp.eval(), embed, head


def target_step(cfg: ModelConfig, layers: int, dev: torch.device, dt: torch.dtype, context: int, bw: float) -> dict:
    """One decode step of a random target truncated to `layers`, timed and set against its memory floor."""
    target = random_target(cfg, layers, dev, dt)
    step_s = time_target_step(target, dev, dt, context)
    nbytes = target_step_bytes(target.cfg, torch.empty(0, dtype=dt).element_size(), context)
    del target
    torch.cuda.empty_cache()
    return {"layers": layers, "context": context, "step_ms": step_s * 1e3, "bytes": nbytes,
            "floor_ms": nbytes["total"] / bw * 1e3, "ratio_to_floor": step_s / (nbytes["total"] / bw)}


def draft_step(mtp, embed, head, cfg: ModelConfig, dev: torch.device, dt: torch.dtype, context: int, k: int,
               folder, bw: float | None, graphs: bool, counts_file=None) -> dict:
    """One chained draft step over a vocabulary of k tokens (0: all), timed and set against its memory floor.
    folder/counts_file: where the token counts for k come from (random weights: the first k ids)."""
    ids = None
    if k:
        # a checkpoint drafts over its most frequent tokens; random weights have no counts: first k ids
        ids = (load_draft_ids(folder, k, cfg.vocab_size, dev, path=counts_file) if folder is not None
               else torch.arange(min(k, cfg.vocab_size), device=dev))
    step_s = time_draft_step(mtp, embed, head, dev, dt, context, ids, graphs=graphs)
    nbytes = draft_step_bytes(cfg, torch.empty(0, dtype=dt).element_size(), context, k or None)
    return {"draft_vocab": k or None, "context": context, "step_ms": step_s * 1e3, "bytes": nbytes,
            "copy_bandwidth_bytes_per_s": bw, "floor_ms": nbytes["total"] / bw * 1e3 if bw else None,
            "ratio_to_floor": step_s / (nbytes["total"] / bw) if bw else None}
