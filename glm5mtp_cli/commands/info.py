"""`glm5mtp info [MODEL | --model NAME] [--json]`: parameters, bytes and cache sizes from the config alone."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console

import profiles

from glm5mtp_cli.commands.options import DEFAULT_MODEL, MODEL
from glm5mtp_cli.diagnostics.report import fit_table
from glm5mtp_cli.errors import UserError

GIB = 2**30
DEFAULT_TOKENS = 131072


def _unit(n: int) -> tuple[float, str]:
    """One unit for every parameter count of a table, picked from its largest: B (1e9), M (1e6) or K."""
    for div, name in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return div, name
    return 1, ""


def _bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


def _render(d: dict, console: Console) -> None:
    tot = d["totals"]
    div, unit = _unit(tot["all"]["params"])
    p = lambda n: f"{n / div:,.3f}" if div > 1 else f"{n:,}"  # noqa: E731
    t = fit_table(console, f"{d['model']}: {d['num_hidden_layers']} target layers + MTP at layers."
                           f"{d['mtp_layer_index']} ({d['checkpoint_dtype']}); parameters in {unit or 'units'}")
    for col in ("component", f"target ({unit})", f"MTP ({unit})", "tensors", "checkpoint"):
        t.add_column(col, justify="left" if col == "component" else "right", no_wrap=col == "component")
    for name, c in d["components"].items():
        if c["all"]["params"]:
            t.add_row(name, p(c["target"]["params"]), p(c["mtp"]["params"]), str(c["all"]["tensors"]),
                      _bytes(c["all"]["bytes"]))
    t.add_row("[bold]total[/bold]", p(tot["target"]["params"]), p(tot["mtp_layer"]["params"]),
              str(tot["all"]["tensors"]), _bytes(tot["all"]["bytes"]), end_section=True)
    t.add_row("active / token", p(tot["active_params_per_token_target"]), p(tot["active_params_per_token_mtp"]), "", "")
    console.print(t)
    _render_state(d["state"], console)
    if "cache" in d:
        _render_cache(d["cache"], console)


def _render_state(state: dict, console: Console) -> None:
    n = state["tokens"]
    s = fit_table(console, f"state per sequence, by component, at {n:,} tokens (bf16)",
                  caption="rows grow with tokens; slots are one fixed-size state per sequence")
    for col in ("component", "kind", "layers", "per token", "fixed", f"at {n:,}"):
        s.add_column(col, justify="left" if col in ("component", "kind") else "right", no_wrap=col == "component")
    for name, v in state["components"].items():
        s.add_row(name, v["kind"], str(v["layers"]), f"{v['bytes_per_token']:,}" if v["bytes_per_token"] else "-",
                  _bytes(v["bytes_per_sequence"]) if v["bytes_per_sequence"] else "-", _bytes(v["bytes_at_tokens"]))
    s.add_row("[bold]total[/bold]", "", "", "", "", _bytes(state["total_at_tokens"]))
    console.print(s)


def _render_cache(cache: dict, console: Console) -> None:
    n = cache["tokens"]
    c = fit_table(console, f"cache bytes per token (target layers {cache['layers']['mla_target']}, "
                           f"indexer layers {cache['layers']['indexer_target']}, + MTP) and at {n:,} tokens",
                  caption=f"per layer, all layers: bytes per token; all, MTP: one sequence of {n:,} tokens")
    for col in ("cache", "per layer", "all layers", "all", "MTP"):
        c.add_column(col, justify="left" if col == "cache" else "right", no_wrap=col == "cache")
    labels = {"mla_bf16": "MLA latent+rope bf16", "mla_fp8": "MLA fp8 (fp8_ds_mla)",
              "indexer_bf16": "indexer keys bf16", "indexer_fp8": "indexer keys fp8+scale"}
    for kind, v in cache["per_kind"].items():
        c.add_row(labels[kind], f"{v['bytes_per_token_per_layer']:,}", f"{v['bytes_per_token_all']:,}",
                  _bytes(v["bytes_at_tokens_all"]), _bytes(v["bytes_at_tokens_mtp"]))
    console.print(c)


def the_model(argument: str | None, option: str | None) -> str:
    """MODEL or --model (every other command's spelling), the default when neither is given."""
    if argument is not None and option is not None and argument != option:
        raise UserError(f"MODEL {argument} and --model {option} differ: give the model once")
    return argument or option or DEFAULT_MODEL


def info_cmd(
    model_arg: Annotated[Optional[str], typer.Argument(metavar="MODEL", show_default=False,
        help=f"Profile ({', '.join(profiles.names())}), local folder, or Hub repo id (org/name); default "
             f"{DEFAULT_MODEL}.")] = None,
    model_opt: Annotated[Optional[str], typer.Option("--model", "-m", metavar="NAME", rich_help_panel=MODEL,
                                                     help="The same as MODEL (as the other commands take it).")] = None,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON document only.")] = False,
    tokens: Annotated[Optional[int], typer.Option("--tokens",
        metavar="N", help=f"Context length for the cache totals (default: {DEFAULT_TOKENS}, or the model's "
                          "max_position_embeddings when smaller).")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token for private or gated repos.")] = None,
) -> None:
    """Parameters and bytes per component, active parameters, and cache bytes per token.

    From the config alone: no weights are read.

    Examples:

      glm5mtp info glm5

      glm5mtp info --model glm5-nano --tokens 2048 --json
    """
    model = the_model(model_arg, model_opt)
    if tokens is not None and tokens <= 0:
        raise UserError(f"--tokens must be positive, got {tokens}")
    from glm5mtp_cli.checkpoint.resolve import resolve_config
    from glm5mtp_cli.diagnostics.info import info_dict

    cfg, _kind = resolve_config(model, revision=revision, token=token)
    if tokens is None:
        tokens = min(DEFAULT_TOKENS, cfg.max_position_embeddings)
    d = info_dict(cfg, tokens=tokens, model=model)
    if json_out:
        print(json.dumps(d, indent=2))
    else:
        _render(d, Console())
