"""`glm5mtp profile`: per-sequence memory by component, concurrency and latency per phase over
--max-seq-len values, for ceiling (sized to --max-seq-len) and budget (sized to the request) allocation."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from glm5mtp_cli.engine import launch
from glm5mtp_cli.checkpoint.resolve import resolve_config
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.engine.parallel import check_tp
from glm5mtp_cli.diagnostics.profile import POLICIES, ProfileConfig, check_flags, parse_lengths, run_profile
from glm5mtp_cli.engine.runtime import DEFAULT_MODEL, load_runtime, pick_device, pick_dtype
from glm5mtp_cli.checkpoint.write import parse_size
from glm5mtp_cli.diagnostics.sizing import fmt_bytes as _fmt, tp_table

_COMPS = ("target_mla", "target_indexer", "drafter_mla", "drafter_indexer", "scratch", "cuda_graphs")


def profile_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Profile name, local folder or Hub repo id.")] = DEFAULT_MODEL,
    max_seq_len: Annotated[str, typer.Option(help="Comma-separated --max-seq-len values to sweep.")] = "4096,32768,131072",
    budget: Annotated[int, typer.Option(help="The request budget in tokens (prompt + new) for budget allocation.")] = 2048,
    gamma: Annotated[int, typer.Option(help="Drafts per verify step.")] = 3,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU; bf16 with --predict-only), fp32, bf16, fp16.")] = "auto",
    layers: Annotated[Optional[int], typer.Option(help="Use only the first K target layers.")] = None,
    predict_only: Annotated[bool, typer.Option(help="From the config only: no weights loaded, nothing measured.")] = False,
    gpu_mem: Annotated[Optional[str], typer.Option(help="Memory for the concurrency estimate, e.g. 141GB "
                                                        "(default: the device's total on CUDA, else 141GB).")] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per cache block.")] = 16,
    repeats: Annotated[int, typer.Option(help="Timed runs per phase (the median is reported).")] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout, nothing else there.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Write a bar chart PNG (needs matplotlib; else terminal bars).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random cache rows and tokens.")] = 0,
    tp: launch.TpOpt = 1,
) -> None:
    """Per-sequence memory by component and latency per phase, ceiling vs budget allocation."""
    kwargs = dict(locals())
    lengths = parse_lengths(max_seq_len)
    c = ProfileConfig(lengths, budget, gamma, block_size, 0, repeats, seed)
    check_flags(c)
    out = Console(stderr=json_out)
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if not predict_only and launch.maybe_spawn(tp, device, model, profile_cmd, kwargs):
        return
    if predict_only:
        cfg, _ = resolve_config(model)
        check_tp(cfg, tp)
        if layers is not None:
            cfg = cfg.with_layers(layers)
        dev = pick_device(device) if device != "auto" else torch.device("cpu")
        dt = pick_dtype(dtype, torch.device("cuda")) if dtype == "auto" else pick_dtype(dtype, dev)
        rt = None
    else:
        rt = load_runtime(model, device, dtype, layers, with_mtp=gamma > 0, progress=not json_out,
                          comm=launch.rank_comm(tp, device))
        cfg, dev, dt = rt.cfg, rt.device, rt.dtype
    check_flags(c, cfg.max_position_embeddings)
    if gpu_mem is not None:
        c.gpu_mem = parse_size(gpu_mem)
    elif dev.type == "cuda":
        c.gpu_mem = torch.cuda.get_device_properties(dev).total_memory
    else:
        c.gpu_mem = 141 * 10**9
    with Progress(console=out, transient=True, disable=json_out) as prog:
        task = prog.add_task("profiling", total=len(lengths) * len(POLICIES))
        doc = run_profile(cfg, dt, c, rt, progress=lambda: prog.advance(task))
    doc["model"] = model
    doc["device"] = str(dev) if rt is not None else None
    doc["predict_only"] = predict_only
    doc["tp"] = tp
    if tp > 1 or predict_only:
        doc["tp_per_gpu"] = tp_table(cfg, c.gpu_mem, doc, tp, with_mtp=gamma > 0)
    plot_note = None
    if plot is not None:
        plot_note = _plot(plot, doc)
    if json_out:
        if plot_note:
            doc["plot"] = plot_note
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    _print(out, doc)
    if "tp_per_gpu" in doc and (tp > 1 or predict_only):
        _print_tp(out, doc)
    if plot is not None:
        if plot_note == "written":
            out.print(f"plot written to {plot}")
        else:
            out.print(f"{plot_note}; terminal bars instead:")
            _bars(out, doc)


def _print(out: Console, doc: dict) -> None:
    measured = not doc["predict_only"]
    t = Table(title=f"per-sequence bytes: {doc['model']} ({doc['model_layers']} target layers, {doc['dtype']}), "
                    f"budget {doc['budget']} tokens, gamma {doc['gamma']}" + ("" if measured else " - predicted only"))
    for col in ("max-seq-len", "policy", "rows"):
        t.add_column(col, justify="right")
    for comp in _COMPS:
        t.add_column(comp.replace("_", " "), justify="right")
    t.add_column("total", justify="right")
    if measured:
        t.add_column("measured (ledger)", justify="right")
    t.add_column("max seqs", justify="right")
    for r in doc["rows"]:
        p = r["per_sequence_bytes"]
        cells = [str(r["max_seq_len"]), r["policy"], str(r["reserved_tokens"]), *[_fmt(p[k]) for k in _COMPS],
                 _fmt(p["total"])]
        if measured:
            m = r["measured_per_sequence_bytes"]
            cells.append(_fmt(m["total"]) + (f" (cuda {_fmt(m['cuda_pool_allocation'])})" if "cuda_pool_allocation" in m else ""))
        cells.append(f"{r['max_concurrent_sequences']:,}")
        t.add_row(*cells)
    out.print(t)
    out.print(f"weights: {_fmt(doc['weights_bytes'])} ({'measured' if measured else 'predicted from the config'}); "
              f"max seqs = (gpu-mem {_fmt(doc['gpu_mem_bytes'])} - weights) // per-sequence total; "
              f"growth per 1k tokens: {_fmt(doc['rows'][0]['growth_per_1k_tokens_bytes'])}")
    out.print(f"scratch: {doc['notes']['scratch']}; cuda graphs: {doc['notes']['cuda_graphs']}")
    if measured:
        lt = Table(title="latency per phase (ms, median) at a context of max-seq-len tokens (random rows)")
        for col in ("context", f"prefill {doc['rows'][0]['latency_ms']['prefill_tokens']} tok", "propose/draft",
                    f"verify {doc['gamma'] + 1} tok", "step"):
            lt.add_column(col, justify="right")
        for r in doc["rows"]:
            if r["policy"] != POLICIES[0]:
                continue
            lat = r["latency_ms"]
            f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            lt.add_row(str(lat["context_tokens"]), f(lat["prefill_ms"]), f(lat["propose_per_draft_ms"]),
                       f(lat["verify_ms"]), f(lat["step_ms"]))
        out.print(lt)


def _print_tp(out: Console, doc: dict) -> None:
    tpd = doc["tp_per_gpu"]
    t = Table(title=f"per GPU under tensor/expert parallelism ({doc['model']}, {doc['model_layers']} target layers, "
                    f"gpu-mem {_fmt(doc['gpu_mem_bytes'])}, cache {doc['dtype']}, budget {doc['budget']} tokens)")
    for col in ("tp", "ckpt", "weights/GPU", "of it replicated", "max-seq-len", "cache/seq (ceiling)",
                "seqs (ceiling)", "cache/seq (budget)", "seqs (budget)"):
        t.add_column(col, justify="right")
    for r in tpd["rows"]:
        t.add_row(str(r["tp"]) + (" *" if r["tp"] == doc["tp"] else ""), r["format"], _fmt(r["weights_per_gpu_bytes"]),
                  _fmt(r["replicated_per_gpu_bytes"]), str(r["max_seq_len"]),
                  _fmt(r["per_sequence_bytes"]["ceiling"]), f"{r['max_concurrent_sequences']['ceiling']:,}",
                  _fmt(r["per_sequence_bytes"]["budget"]), f"{r['max_concurrent_sequences']['budget']:,}")
    out.print(t)
    for note in tpd["notes"]:
        out.print(note, highlight=False)


def _plot(path: Path, doc: dict) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, no PNG written"
    labels = [f"{r['max_seq_len']}\n{r['policy']}" for r in doc["rows"]]
    fig, ax = plt.subplots(figsize=(max(6, len(labels)), 4))
    bottom = [0.0] * len(labels)
    for comp in _COMPS:
        vals = [r["per_sequence_bytes"][comp] / 2**20 for r in doc["rows"]]
        ax.bar(labels, vals, bottom=bottom, label=comp)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB per sequence")
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UserError(f"--plot {path}: {e.strerror}") from None
    return "written"


def _bars(out: Console, doc: dict) -> None:
    top = max(r["per_sequence_bytes"]["total"] for r in doc["rows"]) or 1
    for r in doc["rows"]:
        v = r["per_sequence_bytes"]["total"]
        out.print(f"{r['max_seq_len']:>8} {r['policy']:<8} {'█' * max(1, round(40 * v / top)):<40} {_fmt(v)}",
                  highlight=False)
