"""bench: glm5mtp at gamma 0..4 beside transformers' `generate` on the same checkpoint, one device.

Every glm5mtp configuration warms up with one whole run of its workload (excluded: Triton compiles
a kernel variant the first time a prefill shape needs it, ~1 s per b8 HumanEval run on the H200
when only one batch warmed up), then runs it `repeats` times; the tables report medians. The
configurations of one batch size take turns (each round runs every one once): on the lent H200s one
configuration's speed varied 1.7x between calls (gamma 0 at batch 64 decoded 24.5k to 42k
tokens/s), so a drift of the machine must reach all of a batch's rows alike, not only the last ones.
transformers warms up on one batch. The single draft and target steps against their memory floors are step_bench.py's.
"""

from __future__ import annotations

import logging
import logging.handlers
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from glm5mtp_cli.engine.run import run_generate
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.runtime import Runtime
from glm5mtp_cli.engine.config import GAMMA_POLICIES, EngineConfig
from glm5mtp_cli.core.families import family_of


@dataclass(frozen=True)
class BenchConfig:
    engine: EngineConfig  # tokens per request, schedule, prefill, forward mode (resolved); gamma and
    # batch size are each row's
    gammas: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    repeats: int = 3
    with_transformers: bool = True
    gamma_policies: tuple[str, ...] = ("fixed",)  # each gamma > 0 runs under each
    num_prompts: int | None = None  # None: one prompt per slot; else this many through the batch's slots

    def __post_init__(self):
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not set(self.gamma_policies) <= set(GAMMA_POLICIES):
            raise UserError(f"--gamma-policy takes {', '.join(GAMMA_POLICIES)} or both (comma-separated), "
                            f"got {','.join(self.gamma_policies)!r}")
        if self.engine.max_new_tokens < 2 or self.repeats < 1:
            raise UserError("--max-new-tokens must be >= 2, --repeats and --draft-context >= 1")
        for g in self.gammas:
            self.engine.replace(gamma=g)  # each gamma refused here if out of range, not mid-run
        for b in self.batch_sizes:
            self.engine.replace(batch_size=b)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _workload(prompts: list, batch: int, c: BenchConfig) -> list:
    """The prompts one configuration runs: --num-prompts of them through `batch` slots, else one per slot."""
    return prompts[: c.num_prompts] if c.num_prompts else prompts[:batch]


def systems_of(c: BenchConfig) -> list[tuple[int, str]]:
    """The (gamma, policy) configurations a batch size runs: gamma 0 once (no drafts: no policy)."""
    return [(g, p) for g in c.gammas for p in (("fixed",) if g == 0 else c.gamma_policies)]


def run_glm5mtp(rt: Runtime, prompts: list[list[int]], systems: list[tuple[int, str]], batch: int,
                c: BenchConfig, constraints: list | None = None) -> list[dict]:
    """End to end over the workload (continuous batching through `batch` slots) for each (gamma,
    policy), in turns (module docstring); per configuration the medians of its timed runs, TTFT
    (queue + prefill) and TPOT percentiles over the requests of its median run. constraints: each
    prompt's own (a prompt line's response_format), beside `prompts`."""
    work = _workload(prompts, batch, c)
    rules = _workload(constraints, batch, c) if constraints is not None else None
    runs: dict[tuple[int, str], list] = {s: [] for s in systems}
    compile_s = {}
    for i in range(c.repeats + 1):
        for gamma, policy in systems:
            config = c.engine.replace(gamma=gamma, gamma_policy=policy, batch_size=batch)
            results, acc, lat, _, _ = run_generate(rt, work, config, constraints=rules)
            if i:
                runs[(gamma, policy)].append((acc, lat, _outcomes(results)))
            else:
                compile_s[(gamma, policy)] = lat["compile_s"]  # the first engine's: inductor's caches were the coldest
    return [_row(gamma, policy, runs[(gamma, policy)], compile_s[(gamma, policy)], batch, len(work), c)
            for gamma, policy in systems]


def _outcomes(results) -> dict:
    """How a run's constrained requests ended: how many were constrained, complete, valid (all 0 when none)."""
    mine = [r for r in results if r.constraint is not None]
    return {"constrained": len(mine), "complete": sum(bool(r.complete) for r in mine),
            "valid": sum(bool(r.valid) for r in mine)}


def _row(gamma: int, policy: str, runs: list, compile_s: float, batch: int, prompts: int, c: BenchConfig) -> dict:
    med = lambda key: statistics.median(r[1][key] for r in runs)  # noqa: E731
    system = f"gamma {gamma}" + (" adaptive" if policy == "adaptive" else "") + \
        (" synthetic" if gamma and c.engine.synthetic_acceptance else "") + \
        (f", {c.engine.schedule}" if c.engine.schedule != "continuous" else "")
    return {"system": system, "gamma": gamma, "batch": batch, "graphs": c.engine.graphs, "schedule": c.engine.schedule,
            "gamma_policy": policy, "synthetic_acceptance": c.engine.synthetic_acceptance if gamma else None,
            "e2e_tokens_per_s": med("e2e_tokens_per_s"), "decode_tokens_per_s": med("decode_tokens_per_s"),
            "wall_prefill_s": med("wall_prefill_s"), "wall_decode_s": med("wall_decode_s"),
            "tpot_ms_p50": med("tpot_ms_p50"), "tpot_ms_p99": med("tpot_ms_p99"),
            "ttft_ms_p50": med("ttft_ms_p50"), "ttft_ms_p99": med("ttft_ms_p99"),
            "prompts": prompts, "graph_capture_ms": med("graph_capture_ms"),
            "compile": c.engine.compile, "compile_mode": c.engine.compile_mode, "compile_s": compile_s,
            "admissions": med("admissions"), "gamma_steps": runs[0][1]["gamma_steps"],
            "mean_acceptance_length": runs[0][0].mean_acceptance_length if gamma else 1.0,
            "per_position": runs[0][0].per_position, **runs[0][2]}


def run_transformers(rt: Runtime, prompts: list[list[int]], batch: int, c: BenchConfig) -> dict:
    """transformers' greedy generate with the family's transformers model (target only) on the same weights."""
    family = family_of(rt.cfg)
    try:
        with quiet_transformers():
            model = family.transformers_model(str(rt.resolved.folder), rt.dtype)
    except ImportError:
        raise UserError(f"bench: this transformers ({_transformers_version()}) has no {family.name} model for the "
                        "baseline (GLM-5 needs >= 5.2, GLM-5-Next >= 5.24), or pass --no-transformers") from None
    model = model.to(rt.device).eval()
    work = _workload(prompts, batch, c)
    pad = rt.cfg.pad_token_id or 0
    groups = []  # static batches of `batch` left-padded prompts (transformers' generate has no slots)
    for g0 in range(0, len(work), batch):
        group = work[g0:g0 + batch]
        width = max(len(p) for p in group)
        groups.append((torch.tensor([[pad] * (width - len(p)) + p for p in group], device=rt.device),
                       torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=rt.device)))
    times = []
    # quiet: its first forward logs a 235-character line per kernel it runs in its reference
    # implementation (GLM-5-Next: causal_conv1d's and flash-linear-attention's, CUDA packages)
    with quiet_transformers():
        for i in range(c.repeats + 1):
            _sync(rt.device)
            t0 = time.perf_counter()
            new = 0
            for ids, mask in (groups if i else groups[:1]):  # the warm-up: one batch
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=mask, max_new_tokens=c.engine.max_new_tokens,
                                         min_new_tokens=c.engine.max_new_tokens, do_sample=False, pad_token_id=pad)
                new += (out.shape[1] - ids.shape[1]) * ids.shape[0]
            _sync(rt.device)
            if i:
                times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    del model
    return {"system": "transformers", "gamma": None, "batch": batch, "e2e_tokens_per_s": new / t,
            "decode_tokens_per_s": None, "tpot_ms_p50": t / len(groups) / c.engine.max_new_tokens * 1e3,
            "tpot_ms_p99": None, "ttft_ms_p50": None, "ttft_ms_p99": None, "prompts": len(work),
            "mean_acceptance_length": None, "per_position": None}


@contextmanager
def quiet_transformers():
    """transformers' load report (a table of every checkpoint key its model does not use: the MTP layer's),
    its notes of kernels run in their reference implementation and progress bars stay off the terminal; an error it logs still reaches stderr, with the messages held
    before it, and so do they all when the load raises (its errors say "look at the above report")."""
    from transformers.utils import logging as hf_logging

    held = logging.handlers.MemoryHandler(1 << 16, flushLevel=logging.ERROR, target=logging.StreamHandler(sys.stderr),
                                          flushOnClose=False)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.add_handler(held)
    try:
        yield
    except Exception:
        held.flush()
        raise
    finally:
        hf_logging.remove_handler(held)
        hf_logging.enable_default_handler()
        if bars:
            hf_logging.enable_progress_bar()


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return transformers.__version__


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        base0 = next((x for x in rows if x["batch"] == r["batch"] and x["gamma"] == 0), None)
        hf = next((x for x in rows if x["batch"] == r["batch"] and x["gamma"] is None), None)
        r["speedup_vs_gamma0"] = r["e2e_tokens_per_s"] / base0["e2e_tokens_per_s"] if base0 else None
        r["speedup_vs_transformers"] = r["e2e_tokens_per_s"] / hf["e2e_tokens_per_s"] if hf else None
