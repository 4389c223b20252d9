"""One engine run over a list of prompts: what `generate`, `bench` and `acceptance` all time.

Lives in the engine (not in a command) so that diagnostics can drive exactly what `generate` drives.
"""

from __future__ import annotations

import resource

import torch

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.engine.metrics import Acceptance, Latency
from glm5mtp_cli.engine.runtime import Runtime, make_engine, resolve
from glm5mtp_cli.engine.sequence import Request, SeqResult, budget_tokens, reserve_tokens


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak bytes of this process: the CUDA allocator's on CUDA, else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"


def summarize(results: list[SeqResult], gamma: int, engine) -> tuple[Acceptance, Latency]:
    """End to end = prefill + decode; CUDA-graph capture is one-time setup (as in vLLM and SGLang,
    which capture at start-up), reported on its own, and so is compiling the static forwards
    (--compile; the engine's wall_capture_s includes it, its runner's compile_s is its part). With
    continuous batching prefills interleave with decode steps: prefill is the wall time of the
    admission phases between steps, decode the rest of the run (SpecEngine's docstring), so decode
    tokens/s is over the steps' wall time alone. TTFT counts each request's wait for a slot."""
    acc = Acceptance(gamma)
    lat = Latency()
    for r in results:
        acc.merge(r.acceptance)
        lat.ttft.append(r.ttft_s)
        lat.prefill.append(r.prefill_s)
        lat.propose_per_draft += r.propose_s
        lat.verify += r.verify_s
        if len(r.tokens) > 1:
            lat.tpot.append(r.decode_s / (len(r.tokens) - 1))
    lat.total_tokens = sum(len(r.tokens) for r in results)
    # the first token of each request comes from the prefill; the rest are decode tokens
    lat.decode_tokens = lat.total_tokens - len(results)
    lat.decode_seconds = engine.wall_decode_s
    lat.total_seconds = engine.wall_prefill_s + engine.wall_decode_s
    lat.capture_seconds = engine.wall_capture_s - engine.runner.compile_s
    lat.compile_seconds = engine.runner.compile_s
    lat.admissions = engine.admissions
    lat.gamma_steps = dict(sorted(engine.policy.steps.items()))
    return acc, lat


def check_fits(token_lists: list[list[int]], config: EngineConfig, limit: int, limit_name: str) -> None:
    """Refuse a prompt that cannot fit, before anything is allocated. limit_name says where the limit
    comes from in the user's terms: "--max-seq-len" when given, else "the model's limit"."""
    for i, ids in enumerate(token_lists):
        need = budget_tokens(len(ids), config.max_new_tokens, config.gamma)
        if need > limit:
            raise UserError(f"prompt {i}: {len(ids)} tokens + {config.max_new_tokens} new + gamma {config.gamma} = "
                            f"{need} rows, over {limit_name} ({limit})")


class Stopped(KeyboardInterrupt):
    """Ctrl-C inside run_generate, with the results of the requests that had finished by then."""

    def __init__(self, finished: list[SeqResult]):
        super().__init__()
        self.finished = finished


def run_generate(rt: Runtime, prompts: list[list[int]], config: EngineConfig, on_tokens=None, constraints=None):
    """One engine over all prompts, as `config` says; constraints: each prompt's own (a list beside
    prompts, None entries for the config's, if any). Returns (results, acceptance, latency json,
    per-sequence bytes, pool bytes); raises Stopped on Ctrl-C, every cache given back."""
    config = resolve(rt, config)
    constraints = constraints or [None] * len(prompts)
    requests = [Request(p, config.max_new_tokens, i, constraint=c) for i, (p, c) in enumerate(zip(prompts, constraints))]
    per_seq = max(reserve_tokens(len(r.prompt), r.max_new_tokens, config.gamma, config.alloc, config.max_seq_len)
                  for r in requests)
    pools = rt.make_pools(per_seq, min(config.batch_size, len(requests)), prefill_graphs=config.prefill_graphs)
    engine = make_engine(rt, pools, config)
    engine.lifecycle.on_tokens = on_tokens
    try:
        results = engine.generate(requests)
    except KeyboardInterrupt:
        raise Stopped([r for r in engine.results if r is not None and r.finish_reason]) from None
    finally:
        engine.close()
    acc, lat = summarize(results, config.gamma, engine)
    leftover = pools.blocks_held()
    if any(leftover.values()):
        raise RuntimeError(f"cache blocks still held after generate: {leftover}")
    return results, acc, lat.to_json(), results[0].state_bytes, pools.bytes_total()
