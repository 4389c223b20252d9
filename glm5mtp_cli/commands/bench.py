"""`glm5mtp bench`: side by side on one device: transformers, gamma 0, gamma 1..4; batch 1 and 8."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

from glm5mtp_cli.engine import launch
from glm5mtp_cli.diagnostics.bench import (BenchConfig, add_ratios, copy_bandwidth, random_drafter, random_target,
                    run_glm5mtp, run_transformers, time_draft_step, time_target_step)
from glm5mtp_cli.diagnostics.sizing import draft_step_bytes, target_step_bytes
from glm5mtp_cli.checkpoint.resolve import resolve_config
from glm5mtp_cli.engine.draft_vocab import load_draft_ids
from glm5mtp_cli.engine.runtime import pick_device, pick_dtype
from glm5mtp_cli.commands.generate import read_prompts
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.runtime import DEFAULT_MODEL, graph_mode, load_runtime


def _ints(text: str, flag: str, low: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < low:
        raise UserError(f"{flag}: values must be >= {low}, got {text!r}")
    return vals


def _prompts(rt, prompts: Optional[Path], need: int) -> list[list[int]]:
    default = profile_path(DEFAULT_MODEL)
    if prompts is None and rt.tokenizer is not None and default is not None:
        prompts = default / "prompts.jsonl"
    if prompts is not None and rt.tokenizer is not None:
        ids = read_prompts(rt, None, None, prompts, False)
    else:  # no tokenizer: random prompts of code-prompt length, seeded
        rng = random.Random(0)
        ids = [[rng.randrange(rt.cfg.vocab_size) for _ in range(rng.randrange(24, 64))] for _ in range(need)]
    while len(ids) < need:
        ids = ids + ids
    return ids[:need]


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def bench_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Profile name, local folder or Hub repo id.")] = DEFAULT_MODEL,
    prompts: Annotated[Optional[Path], typer.Option(help="JSONL prompts (default: the shipped model's).")] = None,
    gammas: Annotated[str, typer.Option(help="Comma-separated gammas; 0 is the baseline.")] = "0,1,2,3,4",
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
    max_new_tokens: Annotated[int, typer.Option()] = 128,
    repeats: Annotated[int, typer.Option(help="Timed runs per configuration (after one warm-up).")] = 3,
    transformers: Annotated[bool, typer.Option("--transformers/--no-transformers",
                                               help="Also time transformers' generate (target only).")] = True,
    draft_context: Annotated[int, typer.Option(help="Drafter rows behind the timed single draft step.")] = 4096,
    device: Annotated[str, typer.Option()] = "auto",
    dtype: Annotated[str, typer.Option()] = "auto",
    layers: Annotated[Optional[int], typer.Option(help="Use only the first K target layers.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Only the JSON document on stdout.")] = False,
    random_weights: Annotated[bool, typer.Option(help="Draft step only, with random weights of the model's "
                                                      "config built on the device (e.g. --model glm5).")] = False,
    draft_vocab_sizes: Annotated[str, typer.Option(help="Draft-step vocabularies to time; 0 is the full vocabulary.")] = "0",
    target_layers: Annotated[int, typer.Option(help="With --random-weights on CUDA: also time one decode step of the "
                                                    "target truncated to this many layers (0: skip).")] = 0,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs",
                                              help="On CUDA, replay the engine's forwards and the timed steps as CUDA graphs.")] = True,
    tp: launch.TpOpt = 1,
) -> None:
    """Tokens/s, TPOT and speedups of speculation against gamma 0 and transformers; draft step vs its floor."""
    kwargs = dict(locals())
    c = BenchConfig(_ints(gammas, "--gammas", 0), _ints(batch_sizes, "--batch-sizes", 1), max_new_tokens, repeats,
                    transformers)
    if max_new_tokens < 2 or repeats < 1 or draft_context < 1:
        raise UserError("--max-new-tokens must be >= 2, --repeats and --draft-context >= 1")
    sizes = _ints(draft_vocab_sizes, "--draft-vocab-sizes", 0)
    if tp > 1 and random_weights:
        raise UserError("--random-weights times one device's draft step; drop --tp")
    if target_layers < 0:
        raise UserError(f"--target-layers must be >= 0, got {target_layers}")
    if launch.maybe_spawn(tp, device, model, bench_cmd, kwargs):
        return
    comm = launch.rank_comm(tp, device)
    if comm is not None:
        c.with_transformers = False  # transformers' generate runs on one device: not a tp baseline
    out = Console(stderr=json_out)
    rows = []
    if random_weights:
        dev = pick_device(device)
        dt = pick_dtype(dtype, dev)
        cfg, _ = resolve_config(model)
        mtp, embed, head = random_drafter(cfg, dev, dt)
        folder = None
        c.graphs = "cuda" if cuda_graphs and dev.type == "cuda" else "eager"  # how the steps are timed
    else:
        rt = load_runtime(model, device, dtype, layers, progress=not json_out, comm=comm)
        c.graphs = graph_mode(rt, cuda_graphs)
        cfg, dev, dt, folder = rt.cfg, rt.device, rt.dtype, rt.resolved.folder
        mtp, embed, head = rt.mtp, rt.target.model.embed_tokens, rt.target.lm_head
        ids = _prompts(rt, prompts, max(c.batch_sizes))
    for batch in ([] if random_weights else c.batch_sizes):
        if c.with_transformers:
            out.print(f"[dim]transformers generate, batch {batch}[/dim]")
            rows.append(run_transformers(rt, ids, batch, c))
        for g in c.gammas:
            out.print(f"[dim]glm5mtp gamma {g}, batch {batch}[/dim]")
            rows.append(run_glm5mtp(rt, ids, g, batch, c))
    add_ratios(rows)
    bw = copy_bandwidth(dev)
    drafts = [_draft_step(mtp, embed, head, cfg, dev, dt, draft_context, k, folder, bw, cuda_graphs) for k in sizes]
    target_step = None
    if random_weights and target_layers and dev.type == "cuda":
        del mtp, embed, head
        torch.cuda.empty_cache()
        target_step = _target_step(cfg, target_layers, dev, dt, draft_context, bw)
    doc = {"model": model, "device": str(dev), "tp": comm.world if comm else 1, "graphs": c.graphs,
           "target_step": target_step,
           "dtype": str(dt).replace("torch.", ""), "random_weights": random_weights,
           "max_new_tokens": max_new_tokens, "repeats": repeats, "rows": rows, "draft_step": drafts[0],
           "draft_steps": drafts}
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    t = Table(title=f"bench on {doc['device']} ({doc['dtype']}), {max_new_tokens} new tokens, medians of {repeats}")
    for col in ("batch", "system", "e2e tok/s", "decode tok/s", "TPOT p50 ms", "mean acc. len",
                "vs gamma 0", "vs transformers"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["batch"]), r["system"], _fmt(r["e2e_tokens_per_s"], ".1f"), _fmt(r["decode_tokens_per_s"], ".1f"),
                  _fmt(r["tpot_ms_p50"], ".2f"), _fmt(r["mean_acceptance_length"], ".2f"),
                  _fmt(r["speedup_vs_gamma0"], ".2f"), _fmt(r["speedup_vs_transformers"], ".2f"))
    if rows:
        out.print(t)
    for d in drafts:
        floor = f"floor {d['floor_ms']:.3f} ms ({d['ratio_to_floor']:.2f}x)" if bw else "no floor on the CPU"
        out.print(f"one draft step, vocab {d['draft_vocab'] or cfg.vocab_size}, {draft_context} drafter rows: "
                  f"{d['step_ms']:.3f} ms, reads {d['bytes']['total'] / 1e9:.3f} GB; {floor}")
    if target_step:
        out.print(f"one target decode step, {target_step['layers']} layers, {draft_context} cached rows: "
                  f"{target_step['step_ms']:.3f} ms, reads {target_step['bytes']['total'] / 1e9:.3f} GB; "
                  f"floor {target_step['floor_ms']:.3f} ms ({target_step['ratio_to_floor']:.2f}x)")
    print(json.dumps(doc))  # the closing JSON line


def _target_step(cfg, layers, dev, dt, context, bw) -> dict:
    target = random_target(cfg, layers, dev, dt)
    step_s = time_target_step(target, dev, dt, context)
    nbytes = target_step_bytes(target.cfg, torch.empty(0, dtype=dt).element_size(), context)
    del target
    torch.cuda.empty_cache()
    return {"layers": layers, "context": context, "step_ms": step_s * 1e3, "bytes": nbytes,
            "floor_ms": nbytes["total"] / bw * 1e3, "ratio_to_floor": step_s / (nbytes["total"] / bw)}


def _draft_step(mtp, embed, head, cfg, dev, dt, context, k, folder, bw, graphs) -> dict:
    ids = None
    if k:
        # a checkpoint drafts over its most frequent tokens; random weights have no counts: first k ids
        ids = (load_draft_ids(folder, k, cfg.vocab_size, dev) if folder is not None
               else torch.arange(min(k, cfg.vocab_size), device=dev))
    step_s = time_draft_step(mtp, embed, head, dev, dt, context, ids, graphs=graphs)
    nbytes = draft_step_bytes(cfg, torch.empty(0, dtype=dt).element_size(), context, k or None)
    return {"draft_vocab": k or None, "context": context, "step_ms": step_s * 1e3, "bytes": nbytes,
            "copy_bandwidth_bytes_per_s": bw, "floor_ms": nbytes["total"] / bw * 1e3 if bw else None,
            "ratio_to_floor": step_s / (nbytes["total"] / bw) if bw else None}
