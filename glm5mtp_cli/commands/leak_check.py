"""`glm5mtp leak-check`: sequences through every lifecycle; every cache pool back to its baseline."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from glm5mtp_cli.engine import launch
from glm5mtp_cli.engine.cache import COMPONENTS
from glm5mtp_cli.diagnostics.sizing import fmt_bytes
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.diagnostics.leakcheck import LeakCheckConfig, check_flags, run_leakcheck
from glm5mtp_cli.engine.runtime import DEFAULT_MODEL, graph_mode, load_runtime

_SHORT = {"target_mla": "tgt mla", "target_indexer": "tgt idx", "drafter_mla": "drf mla", "drafter_indexer": "drf idx"}


def _fmt(n: float | int | None) -> str:
    return fmt_bytes(n, digits=1)


def leakcheck_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="Profile name, local folder or Hub repo id.")] = DEFAULT_MODEL,
    sequences: Annotated[int, typer.Option(help="Sequences after the warm-up, cycling length/eos/cancelled/failed.")] = 24,
    gamma: Annotated[int, typer.Option(help="Drafts per verify step.")] = 3,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per sequence (the 'length' lifecycle's end).")] = 16,
    alloc: Annotated[str, typer.Option(help="budget: state sized to each request; ceiling: to --max-seq-len.")] = "budget",
    max_seq_len: Annotated[int, typer.Option(help="Ceiling on prompt + new tokens (what ceiling allocation sizes to).")] = 256,
    device: Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto.")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16.")] = "auto",
    inject_leak: Annotated[Optional[str], typer.Option(
        help=f"Self-test: never free this component ({', '.join(COMPONENTS)}); the check must catch it.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON document on stdout, nothing else there.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    layers: Annotated[Optional[int], typer.Option(help="Use only the first K target layers.")] = None,
    tp: launch.TpOpt = 1,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs",
                                              help="On CUDA, run the engine with CUDA graphs (their slot reuse is checked too).")] = True,
) -> None:
    """Run sequences to every end (length, EOS, cancel, error) and check the cache pools for leaks."""
    kwargs = dict(locals())
    cfg = LeakCheckConfig(sequences, gamma, max_new_tokens, alloc, max_seq_len, inject_leak, seed)
    check_flags(cfg)  # refuse bad flags before loading anything
    if launch.maybe_spawn(tp, device, model, leakcheck_cmd, kwargs):
        return
    out = Console(stderr=json_out)
    rt = load_runtime(model, device, dtype, layers, with_mtp=True, progress=not json_out,
                      comm=launch.rank_comm(tp, device))
    if max_seq_len > rt.cfg.max_position_embeddings:
        raise UserError(f"--max-seq-len {max_seq_len} is over the model's max_position_embeddings "
                        f"{rt.cfg.max_position_embeddings}")
    cfg.graphs = graph_mode(rt, cuda_graphs)
    with out.status("running sequences...", spinner="dots") if not json_out else _Null():
        doc = run_leakcheck(rt, cfg)
    leaked = doc["leaked_bytes_per_sequence"]
    if json_out:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        _print(out, doc)
    if leaked:
        parts = ", ".join(f"{k} (+{_fmt(v)}/sequence)" for k, v in leaked.items())
        Console(stderr=True).print(f"[red]leak:[/red] {parts}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _print(out: Console, doc: dict) -> None:
    comps = list(doc["baseline"]["bytes_held"])
    cuda = doc["device"].startswith("cuda")
    t = Table(title=f"leak-check: {doc['model']} on {doc['device']}, gamma {doc['gamma']}, alloc {doc['alloc']}, "
                    f"max-seq-len {doc['max_seq_len']}" + (f", injected leak: {doc['inject_leak']}" if doc["inject_leak"] else ""))
    t.add_column("seq", justify="right")
    t.add_column("lifecycle")
    t.add_column("finish")
    for c in comps:
        t.add_column(f"{_SHORT.get(c, c)} held", justify="right")
    t.add_column("growth", justify="right")
    t.add_column("cuda growth" if cuda else "RSS growth", justify="right")
    base = doc["baseline"]
    t.add_row("base", "warm-up", "", *[_fmt(base["bytes_held"][c]) for c in comps], "", "")
    for r in doc["sequences"]:
        grow = sum(r["growth_bytes"].values())
        style = "red" if grow > 0 else None
        t.add_row(str(r["sequence"]), r["lifecycle"], r["finish_reason"],
                  *[_fmt(r["bytes_held"][c]) for c in comps], _fmt(grow),
                  _fmt(r.get("cuda_growth_bytes") if cuda else r["rss_growth_bytes"]), style=style)
    out.print(t)
    if not cuda:
        out.print("RSS is reported, not judged (noisy on the CPU); the verdict rests on the pools' ledger.")
    if doc["verdict"] == "clean":
        out.print(f"[green]clean[/green]: every pool component back to its baseline after {len(doc['sequences'])} "
                  f"sequences ({', '.join(doc['lifecycles_seen'])})")
    else:
        lt = Table(title="leaked bytes per sequence")
        lt.add_column("component")
        lt.add_column("bytes/sequence", justify="right")
        for k, v in doc["leaked_bytes_per_sequence"].items():
            lt.add_row(k, f"{v:,.0f} ({_fmt(v)})")
        out.print(lt)
