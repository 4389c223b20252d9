"""`glm5mtp leak-check`: sequences through every lifecycle; every cache pool back to its baseline."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from glm5mtp_cli.commands.options import (BATCHING, DEFAULT_MODEL, GRAPHS, CompileModeOpt, CompileOpt, DeviceOpt,
                                          DtypeOpt, Fp8Opt, JsonOpt, LayersOpt, ModelOpt, RandomWeightsOpt, SyntheticOpt, synthetic_rates,
                                          ThreadsOpt, TpOpt)
from glm5mtp_cli.engine.config import EngineConfig, ModelSpec
from glm5mtp_cli.diagnostics.report import fit_table
from glm5mtp_cli.units import fmt_bytes
from glm5mtp_cli.errors import UserError

if TYPE_CHECKING:  # the engine's modules import torch: not for --help
    from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig

SELF_TEST = "Self-test"  # leak-check's own help panel (options.py holds the shared ones)
_SHORT = {"target_mla": "tgt mla", "target_indexer": "tgt idx", "drafter_mla": "drf mla", "drafter_indexer": "drf idx"}


def _fmt(n: float | int | None) -> str:
    return fmt_bytes(n, digits=1)


def leakcheck_cmd(
    model: ModelOpt = DEFAULT_MODEL,
    sequences: Annotated[int, typer.Option("--sequences", metavar="N",
                                           help="Sequences after the warm-up, cycling length, eos, cancelled, "
                                                "failed (above batch 1 beside one it aborts) and, with a "
                                                "tokenizer, grammar.")] = 24,
    gamma: Annotated[int, typer.Option("--gamma", metavar="N", help="Drafts per verify step.")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", metavar="N",
                                                help="Tokens per sequence (the 'length' lifecycle's end).")] = 16,
    alloc: Annotated[str, typer.Option("--alloc", metavar="NAME", rich_help_panel=BATCHING,
                                       help="budget: state sized to each request; ceiling: to --max-seq-len.")] = "budget",
    max_seq_len: Annotated[int, typer.Option("--max-seq-len", metavar="N", rich_help_panel=BATCHING,
                                             help="Ceiling on prompt + new tokens (what ceiling allocation sizes "
                                                  "to).")] = 256,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    inject_leak: Annotated[Optional[str], typer.Option("--inject-leak", rich_help_panel=SELF_TEST,
        metavar="COMPONENT|tensor:BYTES",
        help="Self-test: never free this state component (GLM-5: target_mla, target_indexer, drafter_mla, "
             "drafter_indexer; GLM-5-Next also target_kda, target_conv, ...), or keep a live tensor of BYTES "
             "per sequence on the device (tensor:1KiB); the check must catch it.")] = None,
    json_out: JsonOpt = False,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the random prompts.")] = 0,
    batch_size: Annotated[int, typer.Option("--batch-size", metavar="N", rich_help_panel=BATCHING,
                                            help="Engine slots; above 1 the sequences run in rounds of twice as many "
                                                 "requests, continuously batched, so slots are re-occupied.")] = 1,
    layers: LayersOpt = None,
    tp: TpOpt = 1,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs", metavar="", rich_help_panel=GRAPHS,
                                              help="On CUDA, run the engine with CUDA graphs (their slot reuse is "
                                                   "checked too).")] = True,
    compile: CompileOpt = None,
    compile_mode: CompileModeOpt = "default",
    random_weights: RandomWeightsOpt = False,
    fp8: Fp8Opt = False,
    threads: ThreadsOpt = None,
    synthetic_acceptance: SyntheticOpt = None,
) -> None:
    """Run sequences to every end (length, EOS, cancel, error) and check the cache pools for leaks.

    Exit code 1 when a leak is found.

    Examples:

      glm5mtp leak-check

      glm5mtp leak-check --sequences 100 --alloc ceiling --json

      # must report the leak and exit 1
      glm5mtp leak-check --inject-leak drafter_mla

      # the memory slope's sensitivity
      glm5mtp leak-check --sequences 100 --inject-leak tensor:1KiB

      # GLM-5's real dimensions, no checkpoint
      glm5mtp leak-check --model glm5 --random-weights --fp8 --layers 4 \\
          --device cuda
    """
    from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig

    spec = ModelSpec(model, device, dtype, layers, random_weights=random_weights, fp8=fp8, tp=tp)
    engine = EngineConfig(gamma=gamma, max_new_tokens=max_new_tokens, batch_size=batch_size, alloc=alloc,
                          max_seq_len=max_seq_len, graphs="auto" if cuda_graphs else "off", compile=compile,
                          compile_mode=compile_mode,
                          synthetic_acceptance=synthetic_rates(synthetic_acceptance))
    run = LeakCheckRun(spec, LeakCheckConfig(engine, sequences, inject_leak, seed), json_out)
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.diagnostics.leakcheck import check_model

    model_cfg = resolve_config(model)[0]  # refuse what the config alone refuses before loading anything
    check_model(run.check, model_cfg)
    limit = model_cfg.max_position_embeddings
    if max_seq_len > limit:
        raise UserError(f"--max-seq-len {max_seq_len} is over the model's limit (max_position_embeddings {limit})")
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.runtime import set_threads

    set_threads(threads)
    launch.run(spec, run_leakcheck_command, run)


@dataclass(frozen=True)
class LeakCheckRun:
    model: ModelSpec
    check: LeakCheckConfig
    json_out: bool


def run_leakcheck_command(run: LeakCheckRun) -> None:
    from glm5mtp_cli.diagnostics.leakcheck import run_leakcheck
    from glm5mtp_cli.engine import launch
    from glm5mtp_cli.engine.runtime import load_runtime

    json_out = run.json_out
    out = Console(stderr=json_out)
    rt = load_runtime(run.model, with_mtp=True, progress=not json_out,
                      comm=launch.rank_comm(run.model.tp, run.model.device))
    with Progress(TextColumn("leak-check"), BarColumn(), MofNCompleteColumn(), TextColumn("sequences"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task("sequences", total=run.check.sequences)
        doc = run_leakcheck(rt, run.check, on_sequence=lambda row: prog.advance(task))
    leaked = doc["leaked_bytes_per_sequence"]
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        _print(out, doc)
    if leaked:
        parts = ", ".join(f"{k} (+{_fmt(v)}/sequence)" for k, v in leaked.items())
        Console(stderr=True).print(f"[red]leak:[/red] {parts}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _print(out: Console, doc: dict) -> None:
    comps = list(doc["baseline"]["bytes_held"])
    cuda = doc["device"].startswith("cuda")
    wide = out.width >= 100
    t = fit_table(out, f"leak-check: {doc['model']} on {doc['device']}, gamma {doc['gamma']}, alloc {doc['alloc']}, "
                       f"max-seq-len {doc['max_seq_len']}" +
                       (f", injected leak: {doc['inject_leak']}" if doc["inject_leak"] else "") +
                       (f", synthetic acceptance {','.join(f'{p:g}' for p in doc['synthetic_acceptance'])}"
                        if doc["synthetic_acceptance"] else ""),
                  caption=None if wide else "held: pool bytes held after the sequence, all components (--json or a "
                                            "terminal of 100+ columns: per component)")
    t.add_column("seq", justify="right")
    t.add_column("lifecycle")
    t.add_column("finish")
    for c in comps if wide else ["all"]:
        t.add_column(f"{_SHORT.get(c, c)} held", justify="right")
    t.add_column("growth", justify="right")
    t.add_column("cuda growth" if cuda else "tensor growth", justify="right")
    base = doc["baseline"]

    def held(r):
        return [_fmt(r["bytes_held"][c]) for c in comps] if wide else [_fmt(sum(r["bytes_held"].values()))]

    t.add_row("base", "warm-up", "", *held(base), "", "")
    for r in doc["sequences"]:
        grow = sum(r["growth_bytes"].values())
        style = "red" if grow > 0 else None
        t.add_row(str(r["sequence"]), r["lifecycle"], r["finish_reason"], *held(r), _fmt(grow),
                  _fmt(r["cuda_growth_bytes"] if cuda else r["live_tensor_growth_bytes"]), style=style)
    out.print(t)
    m = doc["memory_slope"]
    what = "CUDA allocated bytes" if cuda else "live tensor bytes"
    out.print(f"{what}: {m['bytes_per_sequence']:+,.1f} B a sequence by least squares, "
              f"{m['over_run_bytes']:+,.0f} B over the run (a leak above {m['limit_bytes']} B, two allocation "
              f"units)" + ("" if cuda else "; RSS is in --json, not judged (the allocator keeps freed pages)"),
              highlight=False)
    if doc["verdict"] == "clean":
        out.print(f"[green]clean[/green]: every pool component back to its baseline and no growth of {what} after "
                  f"{len(doc['sequences'])} sequences ({', '.join(doc['lifecycles_seen'])})")
    else:
        lt = fit_table(out, "leaked bytes per sequence")
        lt.add_column("component")
        lt.add_column("bytes/sequence", justify="right")
        for k, v in doc["leaked_bytes_per_sequence"].items():
            lt.add_row(k, f"{v:,.0f} ({_fmt(v)})")
        out.print(lt)
    if doc["ended_otherwise"]:
        ends = ", ".join(f"{r['sequence']} {r['lifecycle']} -> {r['finish_reason']}" for r in doc["ended_otherwise"])
        out.print(f"[yellow]not as named[/yellow]: {len(doc['ended_otherwise'])} of {len(doc['sequences'])} "
                  f"sequences ended otherwise than their lifecycle (sequence {ends}), so the verdict does not cover "
                  f"those lifecycles there", highlight=False)
