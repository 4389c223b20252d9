"""One draft step and one target decode step against their memory floors, at a model's
real dimensions with random weights built on the device (`bench --random-weights`), or on a
loaded model's MTP layer (the draft step of every `bench`).

A step at a context of L rows runs over the engine's pools (engine/cache.py) filled with random
values (MLA latents, indexer rows, recurrent states), so it costs what it costs in the engine
without prefilling L tokens; a step of B sequences (bench --step-batch-sizes) runs B of them, each at
L rows. The floor is the bytes the step must read (sizing.draft_step_bytes, sizing.target_step_bytes:
active weights, cache reads, recurrent state traffic; at B > 1 sizing.batch_step_bytes, the routed
experts the batch touches and every sequence's state) over a copy
bandwidth measured in the same run. Timing: on CUDA the forward is replayed as a CUDA graph (what
the engine replays), timed with device events (GLM-5-Next's target step: the forward only; the
engine replays its KDA commit after it as a graph of its own, engine/static.StaticCommit); every
CPU run is host-timed around a synchronised eager forward. Both report the median of `repeats` runs after 3 warm-ups.

With `compile` (bench --compile, engine/compiled.py) the step's static forward is compiled first (its
compile seconds reported apart), then replayed as a CUDA graph on CUDA, or run and host-timed on the CPU.

With `kernels` (bench --kernels), torch.profiler then records a few more steps (graph replays or
eager forwards) and the step's dict gets "kernels": the top device kernels by time per step with
their share of all kernel time (on the CPU: the top operators by self CPU time), so a step far from
its floor says which kernels (or, when their sum is well below the step time, which gaps) cost it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from glm5mtp_cli.checkpoint.load import build_loaded
from glm5mtp_cli.checkpoint.random import RandomReader
from glm5mtp_cli.diagnostics.sizing import batch_step_bytes, draft_step_bytes, routed_expert_bytes, target_step_bytes
from glm5mtp_cli.engine.draft_vocab import load_draft_ids
from glm5mtp_cli.engine.graphs import ForwardRunner
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of

WARMUPS = 3
PROFILED_STEPS = 5
TOP_KERNELS = 12


@dataclass(frozen=True)
class StepTiming:
    """How bench times its steps, built once from its flags: on which device and dtype, over how many
    sequences (`batch`) at how many cached rows each (`context`), replayed as CUDA graphs where the device has them, compiled (--compile,
    --compile-mode), profiled for their kernels, over how many ranks (each stepping in lockstep), and
    against which copy bandwidth (None: no floor)."""

    device: torch.device
    dtype: torch.dtype
    context: int
    graphs: bool = True
    kernels: bool = False
    compile: tuple[str, str] = ("off", "default")
    tp: int = 1
    bandwidth: float | None = None
    repeats: int = 20
    batch: int = 1  # sequences a step runs, each at `context` rows

    @property
    def static(self) -> bool:
        """Whether the step is the runner's static forward (graph-replayed or compiled), not eager."""
        return (self.graphs and self.device.type == "cuda") or self.compile[0] != "off"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def kernel_breakdown(step, device: torch.device, reset=lambda: None, steps: int = PROFILED_STEPS,
                     top: int = TOP_KERNELS) -> dict:
    """torch.profiler around `steps` calls of `step` (`reset` after each): per step, the `top` device
    kernels by total time (CPU: operators by self time), each with calls, ms and share of the sum."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    step()
    reset()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
            reset()
        _sync(device)
    want = DeviceType.CUDA if cuda else DeviceType.CPU
    rows = [(e.key, e.count, e.self_device_time_total if cuda else e.self_cpu_time_total)
            for e in prof.key_averages() if e.device_type == want]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    return {"source": "cuda kernels" if cuda else "cpu operators (self time)", "steps": steps,
            "total_ms_per_step": total_us / steps / 1e3, "kinds": len(rows),
            "calls_per_step": sum(r[1] for r in rows) / steps,
            "top": [{"name": name, "calls_per_step": count / steps, "ms_per_step": us / steps / 1e3,
                     "share": us / total_us} for name, count, us in rows[:top]]}


def _step_runner(t: StepTiming) -> ForwardRunner:
    """The runner of a timed static step: CUDA graphs with `graphs` on CUDA, else static forwards
    run eagerly; compiled unless compile[0] is "off"."""
    return ForwardRunner("cuda" if t.graphs and t.device.type == "cuda" else "static", t.device, *t.compile)


def _static_step(f, runner: ForwardRunner, t: StepTiming) -> tuple[float, dict | None, float | None]:
    """A one-row static forward the runner built (ForwardRunner.sequences_step): its replays' median
    device time when captured, else host-timed runs; then the kernel breakdown with `kernels`, and
    the compile seconds (None: not compiled)."""
    compile_s = runner.compile_s if runner.compile != "off" else None
    if f.graph is None:
        return (_host_seconds(f.run, lambda: None, f.device, t.repeats),
                kernel_breakdown(f.run, f.device) if t.kernels else None, compile_s)
    seconds = _replay_seconds(f.run, t.repeats)
    if not t.kernels:
        return seconds, None, compile_s
    prof = kernel_breakdown(f.run, f.device)
    if not prof["top"]:  # a profiler that does not see kernels inside graph replays: the same forward, eager
        prof = kernel_breakdown(f._forward, f.device)
        prof["source"] += " (eager forwards: none seen in graph replays)"
    return seconds, prof, compile_s


def _replay_seconds(run, repeats: int) -> float:
    """Median device time of one call of `run` (CUDA events around each; after the warm-ups)."""
    for _ in range(WARMUPS):
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


def _host_seconds(step, reset, device: torch.device, repeats: int) -> float:
    """Median host time of a synchronised `step` (after the warm-ups); `reset` (untimed) after each."""
    times = []
    for i in range(repeats + WARMUPS):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= WARMUPS:
            times.append(time.perf_counter() - t0)
        reset()
    return statistics.median(times)


def _fill_random(pools) -> None:
    for pool in pools.pools.values():
        pool.data.normal_(0, 1)


def time_draft_step(drafter: tuple, t: StepTiming, draft_ids: torch.Tensor | None = None
                    ) -> tuple[float, dict | None, float | None]:
    """Median seconds of one chained draft step of drafter (mtp, embed, head; sharded over t.tp
    ranks) over t.batch sequences at t.context drafter rows each: one new row appended and dropped
    again. CUDA graph replays with t.graphs on CUDA, else eager (compiled: the static forward,
    _static_step). With t.kernels, also the step's kernel_breakdown (else None); then the compile
    seconds (None: not compiled)."""
    from glm5mtp_cli.engine.cache import CachePools
    from glm5mtp_cli.engine.config import EngineConfig
    from glm5mtp_cli.engine.mtp_head import MtpHead

    mtp, embed, head = drafter
    cfg, context, device, b = mtp.cfg, t.context, t.device, t.batch
    # one state slot per sequence: the drafter keeps none, but the pools hold the target's too (one
    # per block would be 137 GiB of GLM-5-Next's KDA states at batch 8)
    pools = CachePools.create(cfg, b * math.ceil((context + 8) / 16), 16, t.dtype, device, tp=t.tp, num_slots=b)
    # GLM-5-Next always chains on the post-norm hidden (its config has no such switch)
    head_ = MtpHead(mtp, embed, head, pools, EngineConfig(max_seq_len=context + 8), draft_ids,
                    carry_normed=getattr(cfg, "mtp_carry_normed_hidden", True))
    states = []
    out_head = head_.draft_head or head
    try:
        for _ in range(b):
            states.append(head_.alloc_state_for(context + 8))
        _fill_random(pools)
        caches = [s.cache for s in states]
        for s in states:
            s.cache.length = s.real_rows = context
        hidden = torch.randn(b, 1, cfg.hidden_size, device=device, dtype=t.dtype)
        tokens = torch.ones(b, 1, dtype=torch.long, device=device)
        if t.static:
            runner = _step_runner(t)
            try:
                f = runner.sequences_step(head_.context,
                                          lambda f: head_.drafter_forward(f.ids, f.hidden, f.context(f.starts, 1), "last"),
                                          caches, tokens, hidden)
                return _static_step(f, runner, t)
            finally:
                runner.close()

        def step():
            mtp(tokens, hidden, caches, embed, out_head, rows="last")

        def reset():
            for c in caches:
                c.truncate(context)

        return (_host_seconds(step, reset, device, t.repeats),
                kernel_breakdown(step, device, reset) if t.kernels else None, None)
    finally:
        for s in states:
            head_.free_state(s)


def time_target_step(target, t: StepTiming) -> tuple[float, dict | None, float | None]:
    """Median seconds of one decode step of `target` (sharded over t.tp ranks) over t.batch
    sequences at t.context cached rows each: CUDA graph replays with t.graphs on CUDA (compiled:
    _static_step); else an eager forward of one row each plus the commit of their fixed-size state
    (what the engine's commit after a verify writes), host-timed. With t.kernels, also the step's
    kernel_breakdown (else None); then the compile seconds (None: not compiled)."""
    from glm5mtp_cli.engine.cache import CachePools

    cfg, context, device, b = target.cfg, t.context, t.device, t.batch
    pools = CachePools.create(cfg, b * math.ceil((context + 8) / 16), 16, t.dtype, device, with_drafter=False,
                              tp=t.tp, num_slots=b)
    caches = []
    try:
        for _ in range(b):
            caches.append(pools.target_cache())
            caches[-1].reserve(context + 8)
        _fill_random(pools)
        for c in caches:
            c.length = context
        ids = torch.ones(b, 1, dtype=torch.long, device=device)
        if t.static:
            runner = _step_runner(t)
            try:
                f = runner.sequences_step(target.context,
                                          lambda f: target.forward_batch(f.ids, f.context(f.starts, 1), "last"),
                                          caches, ids)
                return _static_step(f, runner, t)
            finally:
                runner.close()
        keep = torch.ones(b, dtype=torch.long, device=device)

        def step():
            target.commit(target(ids, caches, rows="last").pending, keep)  # keeps the row's recurrent state
            for c in caches:
                c.truncate(context + 1)

        def reset():
            for c in caches:
                c.length = context  # the next step overwrites that row; states stay random-like

        return (_host_seconds(step, reset, device, t.repeats),
                kernel_breakdown(step, device, reset) if t.kernels else None, None)
    finally:
        for c in caches:
            c.release()


def check_target_layers(cfg, layers: int) -> None:
    """One UserError line unless the first `layers` layers hold every kind of per-sequence state
    the full target holds (GLM-5-Next: KDA and indexed MLA layers, as cfg.layer_types places them)."""
    n = cfg.num_hidden_layers
    if not 1 <= layers <= n:
        raise UserError(f"--target-layers must be in 1..{n} (0: skip), got {layers}")
    family = family_of(cfg)
    full = {c.name for c in family.state_components(cfg, torch.float32, with_drafter=False)}
    kept = {c.name for c in family.state_components(cfg.with_layers(layers), torch.float32, with_drafter=False)}
    if kept != full:
        raise UserError(f"--target-layers {layers}: layers 0..{layers - 1} hold no {', '.join(sorted(full - kept))} "
                        "state; the step must include every kind of layer the model has: give more layers")


def _sharded(comm) -> bool:
    return comm is not None and comm.world > 1


def random_target(cfg, layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0, comm=None):
    """The target truncated to `layers` layers with random weights (checkpoint.random's initialiser)
    built on the device; with `comm` (parallel.Comm) this rank's shard, by the family's shard_target
    (the values are the slices of the one-device tensors)."""
    family = family_of(cfg)
    reader = RandomReader(cfg, seed)
    shard = (lambda m: family.shard_target(m, comm)) if _sharded(comm) else None
    return build_loaded(lambda: family.build_target(cfg.with_layers(layers)), reader, "", dtype, device,
                        family.keeps_fp32, shard, what="target").eval()


def _top_level(reader: RandomReader, suffix: str) -> str:
    """The prefix of the target's own `suffix` tensor (embed_tokens, lm_head) in the family's layout."""
    name = next(n for n in reader.shapes if n.endswith(suffix) and ".layers." not in n)
    return name[:-len("weight")]


def _vocab_module(build, reader: RandomReader, suffix: str, dtype: torch.dtype, device: torch.device,
                  comm, parallel) -> torch.nn.Module:
    """The target's `suffix` tensor as a module: `build()` on one device, else this rank's rows of
    the vocabulary (`parallel`, engine.parallel's vocab-parallel module, as shard_target makes it)."""
    prefix = _top_level(reader, suffix)
    if not _sharded(comm):
        return build_loaded(build, reader, prefix, dtype, device)
    vocab, hidden = reader.shape(prefix + "weight")
    return build_loaded(lambda: parallel(vocab, hidden, comm), reader, prefix, dtype, device,
                        shard=lambda m: {prefix + "weight": (0, m.start, m.stop)})


def random_drafter(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0, comm=None):
    """The MTP layer, embeddings and head with random weights (checkpoint.random's initialiser)
    built on the device: real dimensions without a checkpoint on disk (the draft step's time does
    not depend on the values). With `comm` (parallel.Comm): this rank's shard, split as the runtime
    splits them (the family's shard_mtp; embeddings and head by vocabulary)."""
    from torch import nn

    from glm5mtp_cli.core.parallel import VocabParallelEmbedding, VocabParallelHead

    family = family_of(cfg)
    reader = RandomReader(cfg, seed)
    prefix = family.mtp_prefix(cfg)
    shard = (lambda m: family.shard_mtp(m, comm, prefix)) if _sharded(comm) else None
    mtp = build_loaded(lambda: family.build_mtp(cfg), reader, prefix, dtype, device, family.keeps_fp32, shard,
                       what="MTP layer")
    embed = _vocab_module(lambda: nn.Embedding(cfg.vocab_size, cfg.hidden_size), reader, "embed_tokens.weight",
                          dtype, device, comm, VocabParallelEmbedding)
    head = _vocab_module(lambda: nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False), reader, "lm_head.weight",
                         dtype, device, comm, VocabParallelHead)
    return mtp.eval(), embed, head


def _timing(t: StepTiming) -> dict:
    """How a step was timed: "timing" (cuda graph, static or eager) and the compile setting."""
    timing = "cuda graph" if t.graphs and t.device.type == "cuda" else ("static" if t.compile[0] != "off" else "eager")
    return {"timing": timing, "compile": t.compile[0], "compile_mode": t.compile[1]}


def _elem(t: StepTiming) -> int:
    return torch.empty(0, dtype=t.dtype).element_size()


def _batch_bytes(cfg, one: dict, owner: str, t: StepTiming) -> dict:
    """A step's reads over t.batch sequences: one sequence's components (sizing's batch-1 step), and
    in "total" the batch's (sizing.batch_step_bytes; the one sequence's total at batch 1)."""
    if t.batch == 1:
        return one
    routed = routed_expert_bytes(cfg, _elem(t), t.tp)[owner]
    total = batch_step_bytes(one, routed, t.batch, t.batch, cfg.n_routed_experts, cfg.num_experts_per_tok)
    return {**one, "total": int(total)}


def _against_floor(step_s: float, nbytes: dict, t: StepTiming, kernels: dict | None, compile_s: float | None) -> dict:
    bw = t.bandwidth
    floor = nbytes["total"] / bw if bw else None
    return {"step_ms": step_s * 1e3, "compile_s": compile_s, "bytes": nbytes, "copy_bandwidth_bytes_per_s": bw,
            "floor_ms": floor * 1e3 if floor else None, "ratio_to_floor": step_s / floor if floor else None,
            "kernels": kernels}


def target_step(cfg, layers: int, t: StepTiming, comm=None) -> dict:
    """One decode step of a random target truncated to `layers`, timed and set against its memory floor
    (with t.kernels: and its kernel breakdown; compiled first with t.compile, engine/compiled.py).
    With `comm` (t.tp ranks): this rank's shard, every rank stepping in lockstep; the floor counts
    this rank's bytes."""
    target = random_target(cfg, layers, t.device, t.dtype, comm=comm)
    step_s, prof, compile_s = time_target_step(target, t)
    nbytes = _batch_bytes(target.cfg, target_step_bytes(target.cfg, _elem(t), t.context, t.tp), "target", t)
    del target
    if t.device.type == "cuda":
        torch.cuda.empty_cache()
    return {"layers": layers, "batch": t.batch, "context": t.context, **_timing(t),
            **_against_floor(step_s, nbytes, t, prof, compile_s)}


def draft_step(drafter: tuple, t: StepTiming, k: int, folder=None, counts_file=None) -> dict:
    """One chained draft step of drafter (mtp, embed, head) over a vocabulary of k tokens (0: all),
    timed and set against its memory floor (with t.kernels: and its kernel breakdown).
    folder/counts_file: where the token counts for k come from (random weights: the first k ids).
    The drafter is sharded over t.tp ranks (every rank steps in lockstep; the floor counts this
    rank's bytes); a draft vocabulary (k > 0) needs tp 1."""
    cfg, ids = drafter[0].cfg, None
    if k:
        # a checkpoint drafts over its most frequent tokens; random weights have no counts: first k ids
        ids = (load_draft_ids(folder, k, cfg.vocab_size, t.device, path=counts_file) if folder is not None
               else torch.arange(min(k, cfg.vocab_size), device=t.device))
    step_s, prof, compile_s = time_draft_step(drafter, t, ids)
    nbytes = _batch_bytes(cfg, draft_step_bytes(cfg, _elem(t), t.context, k or None, t.tp), "mtp", t)
    return {"draft_vocab": k or None, "batch": t.batch, "context": t.context, **_timing(t),
            **_against_floor(step_s, nbytes, t, prof, compile_s)}
