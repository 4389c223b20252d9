"""`glm5mtp profile`: per-sequence memory by component, concurrency and latency per phase over
--max-seq-len values, for ceiling (sized to --max-seq-len) and budget (sized to the request) allocation."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.progress import Progress

from glm5mtp_cli.commands.options import (DEFAULT_MODEL, MODEL, OUTPUT, DeviceOpt, JsonOpt, LayersOpt, ModelOpt,
                                          ThreadsOpt, TpOpt)
from glm5mtp_cli.commands.plotting import check_plot, pyplot, save
from glm5mtp_cli.diagnostics.report import fit_table
from glm5mtp_cli.engine.config import ModelSpec
from glm5mtp_cli.units import fmt_bytes as _fmt

if TYPE_CHECKING:  # the engine's modules import torch: not for --help
    from glm5mtp_cli.diagnostics.profile import ProfileConfig

_SHORT = {"scratch": "scratch", "cuda_graphs": "CUDA graphs"}


def _components(doc: dict) -> list[str]:
    """The rows' per-sequence components in the family's order (state first, then scratch and graphs)."""
    return [k for k in doc["rows"][0]["per_sequence_bytes"] if k != "total"]


def _label(component: str) -> str:
    return _SHORT.get(component, component.replace("_", " "))
DEFAULT_LENGTHS = (4096, 32768, 131072)


def _short_bytes(n) -> str:
    """Bytes in at most 7 characters (K/M/G/T = KiB/MiB/GiB/TiB), for the narrow transposed table."""
    if n is None:
        return "-"
    for unit, div in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(n) >= div:
            v = n / div
            return f"{v:.2f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{int(n)}B"


def default_lengths(limit: int) -> tuple[list[int], str | None]:
    """4096, 32768, 131072 up to the model's limit; the limit itself when some were over it (with a note)."""
    fits = [n for n in DEFAULT_LENGTHS if n <= limit]
    if len(fits) == len(DEFAULT_LENGTHS):
        return fits, None
    lengths = fits + [limit] if limit not in fits else fits
    if len(lengths) == 1:  # a small model: a short sweep below its limit
        lengths = sorted({max(16, limit // 4), max(16, limit // 2), limit})
    return lengths, (f"--max-seq-len: swept {','.join(map(str, lengths))} (the defaults "
                     f"{','.join(map(str, DEFAULT_LENGTHS))} clipped to the model's limit, "
                     f"max_position_embeddings {limit})")


def profile_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    max_seq_len: Annotated[Optional[str], typer.Option("--max-seq-len",
        metavar="LIST", help="Comma-separated --max-seq-len values to sweep, e.g. 4096,32k (default: 4096,32768,131072 "
                             "up to the model's limit).")] = None,
    budget: Annotated[Optional[int], typer.Option("--budget",
        metavar="TOKENS", help="The request budget in tokens (prompt + new) for budget allocation "
                               "(default: 2048, at most half the smallest --max-seq-len).")] = None,
    gamma: Annotated[int, typer.Option("--gamma", metavar="N", help="Drafts per verify step.")] = 3,
    device: DeviceOpt = "auto",
    dtype: Annotated[str, typer.Option("--dtype", metavar="DTYPE", rich_help_panel=MODEL,
                                       help="auto (bf16 on CUDA, fp32 on CPU; bf16 with --predict-only), fp32, bf16, "
                                            "fp16.")] = "auto",
    layers: LayersOpt = None,
    predict_only: Annotated[bool, typer.Option("--predict-only", metavar="",
                                               help="From the config only: no weights loaded, nothing measured.")] = False,
    gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", metavar="SIZE", help="Memory for the concurrency estimate, e.g. "
                                                   "141GB (default: the device's total on CUDA, else 141GB).")] = None,
    block_size: Annotated[int, typer.Option("--block-size", metavar="N", help="Tokens per cache block.")] = 16,
    repeats: Annotated[int, typer.Option("--repeats", metavar="N",
                                         help="Timed runs per phase (the median is reported).")] = 5,
    json_out: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", metavar="FILE.png", rich_help_panel=OUTPUT,
                                                 help="Write a PNG of the per-sequence bytes and, when measured, the "
                                                      "latency per phase against --max-seq-len (needs the plot "
                                                      "extra: pip install 'glm5mtp\\[plot]').")] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the random cache rows and tokens.")] = 0,
    tp: TpOpt = 1,
    threads: ThreadsOpt = None,
) -> None:
    """Per-sequence memory by component and latency per phase, ceiling vs budget allocation.

    Examples:

      glm5mtp profile

      glm5mtp profile --model glm5 --predict-only --max-seq-len 4096,32k,128k --tp 8

      glm5mtp profile --max-seq-len 512,2048 --budget 256 --json > profile.json
    """
    from glm5mtp_cli.diagnostics.profile import ProfileConfig, check_flags, parse_lengths

    lengths = parse_lengths(max_seq_len) if max_seq_len is not None else None
    spec = ModelSpec(model, device, dtype, layers, tp=tp)
    check_plot(plot)
    from glm5mtp_cli.checkpoint.resolve import resolve_config

    cfg, _ = resolve_config(model)  # the config alone: every flag is checked before any weights load
    limit = cfg.max_position_embeddings
    note = None
    if lengths is None:
        lengths, note = default_lengths(limit)
    if budget is None:
        budget = min(2048, min(lengths) // 2)
    c = ProfileConfig(lengths, budget, gamma, block_size, 0, repeats, seed)
    check_flags(c, limit)
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.runtime import set_threads

    from glm5mtp_cli.checkpoint.write import parse_size

    set_threads(threads)
    gpu_bytes = parse_size(gpu_mem, "--gpu-mem") if gpu_mem is not None else None
    run = ProfileRun(spec, c, lengths, note, predict_only, gpu_bytes, plot, json_out)
    if predict_only:
        run_profile_command(run)  # nothing loads: no ranks
    else:
        launch.run(spec, run_profile_command, run)


@dataclass
class ProfileRun:
    """Everything `profile` decided from its flags: what each rank runs (run_profile_command)."""

    model: ModelSpec
    profile: ProfileConfig
    lengths: list[int]
    note: str | None  # how the default lengths were clipped
    predict_only: bool
    gpu_bytes: int | None
    plot: Path | None
    json_out: bool


def run_profile_command(run: ProfileRun) -> None:
    import torch

    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.diagnostics.profile import POLICIES, run_profile
    from glm5mtp_cli.diagnostics.sizing import tp_table
    from glm5mtp_cli.core.parallel import check_tp
    from glm5mtp_cli.engine.runtime import load_runtime, pick_device, pick_dtype

    spec, c, lengths, note, json_out = run.model, run.profile, run.lengths, run.note, run.json_out
    model, device, dtype, layers, tp, gamma = spec.name, spec.device, spec.dtype, spec.layers, spec.tp, c.gamma
    predict_only, gpu_bytes, plot = run.predict_only, run.gpu_bytes, run.plot
    cfg, _ = resolve_config(model)
    out = Console(stderr=json_out)
    err = Console(stderr=True)
    if note:
        err.print(f"[dim]{note}[/dim]", highlight=False)
    if predict_only:
        check_tp(cfg, tp)  # the family's sharding rules' sizes, before anything loads
        if layers is not None:
            cfg = cfg.with_layers(layers)
        dev = pick_device(device) if device != "auto" else torch.device("cpu")
        dt = pick_dtype(dtype, torch.device("cuda")) if dtype == "auto" else pick_dtype(dtype, dev)
        rt = None
    else:
        rt = load_runtime(spec, with_mtp=gamma > 0, progress=not json_out, comm=launch.rank_comm(tp, device))
        cfg, dev, dt = rt.cfg, rt.device, rt.dtype
    if gpu_bytes is not None:
        c.gpu_mem = gpu_bytes
    elif dev.type == "cuda":
        c.gpu_mem = torch.cuda.get_device_properties(dev).total_memory
    else:
        c.gpu_mem = 141 * 10**9
    with Progress(console=err, transient=True) as prog:
        task = prog.add_task("profiling", total=len(lengths) * len(POLICIES))
        doc = run_profile(cfg, dt, c, rt, progress=lambda: prog.advance(task))
    doc["model"] = model
    doc["device"] = str(dev) if rt is not None else None
    doc["predict_only"] = predict_only
    doc["tp"] = tp
    if tp > 1 or predict_only:
        doc["tp_per_gpu"] = tp_table(cfg, c.gpu_mem, doc, tp, gamma > 0, dt)
    if plot is not None:
        _plot(plot, doc)
        doc["plot"] = "written"
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    _print(out, doc)
    if "tp_per_gpu" in doc and (tp > 1 or predict_only):
        _print_tp(out, doc)
    if plot is not None:
        out.print(f"plot written to {plot}")


def _print(out: Console, doc: dict) -> None:
    from glm5mtp_cli.diagnostics.profile import POLICIES

    measured = not doc["predict_only"]
    title = (f"per-sequence bytes: {doc['model']} ({doc['model_layers']} target layers, {doc['dtype']}), "
             f"budget {doc['budget']} tokens, gamma {doc['gamma']}" + ("" if measured else ", predicted only"))
    rows = doc["rows"]
    narrow = out.width < 100 or len(rows) <= 4
    b = _short_bytes if narrow else _fmt
    lines = [(_label(k), lambda r, k=k: b(r["per_sequence_bytes"][k])) for k in _components(doc)]
    lines.append(("total", lambda r: b(r["per_sequence_bytes"]["total"])))
    if measured:
        lines.append(("measured (ledger)", lambda r: b(r["measured_per_sequence_bytes"]["total"])))
        if any("cuda_pool_allocation" in r["measured_per_sequence_bytes"] for r in doc["rows"]):
            lines.append(("CUDA allocator", lambda r: b(r["measured_per_sequence_bytes"].get("cuda_pool_allocation"))))
    lines.append(("max seqs", lambda r: f"{r['max_concurrent_sequences']:,}"))
    if narrow:
        # transposed: one column per (max-seq-len, policy); fits 80 columns for up to 3 lengths
        t = fit_table(out, title, caption="ceil: state sized to --max-seq-len; budg: sized to the request budget; "
                                          "rows: cache rows reserved per sequence; K/M/G: KiB/MiB/GiB")
        t.add_column("", no_wrap=True)
        for r in rows:
            t.add_column(f"{r['max_seq_len']}\n{'ceil' if r['policy'] == 'ceiling' else 'budg'}", justify="right")
        t.add_row("rows", *[str(r["reserved_tokens"]) for r in rows], end_section=True)
        for label, cell in lines:
            t.add_row(label, *[cell(r) for r in rows])
    else:
        t = fit_table(out, title, caption="rows: cache rows reserved per sequence")
        for col in ("max-seq-len", "policy", "rows", *[label for label, _ in lines]):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r["max_seq_len"]), r["policy"], str(r["reserved_tokens"]), *[cell(r) for _, cell in lines])
    out.print(t)
    out.print(f"weights: {_fmt(doc['weights_bytes'])} ({'measured' if measured else 'predicted from the config'}); "
              f"max seqs = (gpu-mem {_fmt(doc['gpu_mem_bytes'])} - weights) // per-sequence total; "
              f"growth per 1k tokens: {_fmt(doc['rows'][0]['growth_per_1k_tokens_bytes'])}", highlight=False)
    out.print(f"scratch: {doc['notes']['scratch']}; cuda graphs: {doc['notes']['cuda_graphs']}", highlight=False)
    if measured:
        lt = fit_table(out, "latency per phase (ms, median) at a context of max-seq-len tokens (random rows)")
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
    """Three tables that each fit 80 columns: weights per GPU; state and transient bytes per sequence
    per GPU; bytes per sequence and concurrency per GPU."""
    tpd = doc["tp_per_gpu"]
    mark = lambda n: f"{n} *" if n == doc["tp"] else str(n)  # noqa: E731
    legend = f"* the --tp of this run ({doc['tp']})"
    w = fit_table(out, f"weights per GPU under tensor/expert parallelism ({doc['model']}, {doc['model_layers']} "
                       "target layers)", caption=legend)
    for col in ("tp", "ckpt", "weights/GPU", "of it replicated"):
        w.add_column(col, justify="right")
    seen = set()
    for r in tpd["rows"]:
        if (r["tp"], r["format"]) not in seen:
            seen.add((r["tp"], r["format"]))
            w.add_row(mark(r["tp"]), r["format"], _fmt(r["weights_per_gpu_bytes"]), _fmt(r["replicated_per_gpu_bytes"]))
    out.print(w)
    s = fit_table(out, f"bytes per sequence per GPU (cache {doc['dtype']}, budget {doc['budget']} tokens)",
                  caption=legend + "; state: the cache pools' share of this rank; scratch+graphs: one verify's "
                                   "activations and the CUDA-graph buffers (tp 1 values)")
    for col in ("tp", "max-seq-len", "state ceil", "state budg", "scratch+graphs ceil", "budg"):
        s.add_column(col, justify="right")
    seen = set()
    for r in tpd["rows"]:
        if (r["tp"], r["max_seq_len"]) not in seen:
            seen.add((r["tp"], r["max_seq_len"]))
            st, tr = r["state_per_sequence_bytes"], r["scratch_graphs_per_sequence_bytes"]
            s.add_row(mark(r["tp"]), str(r["max_seq_len"]), _fmt(st["ceiling"]), _fmt(st["budget"]),
                      _fmt(tr["ceiling"]), _fmt(tr["budget"]))
    out.print(s)
    t = fit_table(out, f"sequences per GPU (gpu-mem {_fmt(doc['gpu_mem_bytes'])}, cache {doc['dtype']}, "
                       f"budget {doc['budget']} tokens)", caption=legend)
    for col in ("tp", "ckpt", "max-seq-len", "bytes/seq ceil", "seqs", "bytes/seq budg", "seqs"):
        t.add_column(col, justify="right")
    for r in tpd["rows"]:
        t.add_row(mark(r["tp"]), r["format"], str(r["max_seq_len"]),
                  _fmt(r["per_sequence_bytes"]["ceiling"]), f"{r['max_concurrent_sequences']['ceiling']:,}",
                  _fmt(r["per_sequence_bytes"]["budget"]), f"{r['max_concurrent_sequences']['budget']:,}")
    out.print(t)
    for note in tpd["notes"]:
        out.print(note, highlight=False)


def _plot(path: Path, doc: dict) -> None:
    save(_figure(doc), path)


def _figure(doc: dict):
    """Per-sequence bytes by component (a stacked bar per --max-seq-len and policy) and, where measured,
    latency per phase against --max-seq-len beside them, under a title of what they were taken at."""
    from glm5mtp_cli.diagnostics.profile import POLICIES

    plt = pyplot()
    rows = doc["rows"]
    latency = [r["latency_ms"] for r in rows if r["policy"] == POLICIES[0] and r["latency_ms"]]
    labels = [f"{r['max_seq_len']}\n{r['policy']}" for r in rows]
    fig, axes = plt.subplots(1, 2 if latency else 1, figsize=(max(6, len(labels)) + (5 if latency else 0), 4.5),
                             squeeze=False)
    mem = axes[0][0]
    bottom = [0.0] * len(labels)
    for comp in _components(doc):
        vals = [r["per_sequence_bytes"][comp] / 2**20 for r in rows]
        mem.bar(labels, vals, bottom=bottom, label=_label(comp))
        bottom = [b + v for b, v in zip(bottom, vals)]
    mem.set_ylabel("MiB per sequence")
    mem.set_title("memory per sequence" + ("" if latency else " (predicted)"), fontsize="small")
    mem.legend(fontsize="small")
    if latency:
        _latency_panel(axes[0][1], latency, doc["gamma"])
    fig.suptitle(_plot_title(doc), fontsize="medium")
    return fig


def _latency_panel(ax, latency: list[dict], gamma: int) -> None:
    """Median ms per phase against the context (--max-seq-len), as the latency table shows them."""
    context = [lat["context_tokens"] for lat in latency]
    phases = (("step_ms", "step"), ("verify_ms", f"verify {gamma + 1} tok"), ("propose_per_draft_ms", "draft"),
              ("prefill_ms", f"prefill {latency[0]['prefill_tokens']} tok"))
    for key, label in phases:
        vals = [lat[key] for lat in latency]
        if None not in vals:  # no drafts at gamma 0
            ax.plot(context, vals, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(context, labels=[str(n) for n in context])  # the swept lengths, not powers of two
    ax.minorticks_off()
    ax.set_xlabel("--max-seq-len (context, tokens)")
    ax.set_ylabel("ms (median)")
    ax.set_title("latency per phase (measured)", fontsize="small")
    ax.legend(fontsize="small")


def _plot_title(doc: dict) -> str:
    where = ", predicted only" if doc["predict_only"] else f" on {doc['device']}"
    tp = f", tp {doc['tp']}" if doc["tp"] > 1 else ""
    return (f"{doc['model']} ({doc['model_layers']} target layers, {doc['dtype']}){where}{tp}: budget "
            f"{doc['budget']} tokens, gamma {doc['gamma']}")
