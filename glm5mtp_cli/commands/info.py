"""`glm5mtp info MODEL [--json]`: parameters, bytes and cache sizes from the config alone."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from glm5mtp_cli.checkpoint.resolve import resolve_config
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.diagnostics.info import info_dict
from glm5mtp_cli.diagnostics.sizing import fmt_bytes


def _b(n: float) -> str:
    """Billions of parameters, readable at both GLM-5 and tiny sizes."""
    return f"{n / 1e9:.3f} B" if n >= 1e7 else f"{n:,}"


def _render(d: dict, console: Console) -> None:
    t = Table(title=f"{d['model']}: {d['num_hidden_layers']} target layers + MTP at layers.{d['mtp_layer_index']}"
                    f" ({d['checkpoint_dtype']})")
    for col in ("component", "target params", "MTP params", "tensors", "checkpoint bytes"):
        t.add_column(col, justify="left" if col == "component" else "right", no_wrap=col == "component")
    for name, c in d["components"].items():
        if c["all"]["params"]:
            t.add_row(name, _b(c["target"]["params"]), _b(c["mtp"]["params"]), str(c["all"]["tensors"]),
                      fmt_bytes(c["all"]["bytes"]))
    tot = d["totals"]
    t.add_row("[bold]total[/bold]", _b(tot["target"]["params"]), _b(tot["mtp_layer"]["params"]),
              str(tot["all"]["tensors"]), fmt_bytes(tot["all"]["bytes"]), end_section=True)
    t.add_row("active / token", _b(tot["active_params_per_token_target"]), _b(tot["active_params_per_token_mtp"]), "", "")
    console.print(t)
    cache = d["cache"]
    c = Table(title=f"cache per token (target layers {cache['layers']['mla_target']}, "
                    f"indexer layers {cache['layers']['indexer_target']}, + MTP)")
    for col in ("cache", "B/token/layer", "B/token all layers", f"all @ {cache['tokens']} tok", f"MTP @ {cache['tokens']} tok"):
        c.add_column(col, justify="left" if col == "cache" else "right", no_wrap=col == "cache")
    labels = {"mla_bf16": "MLA latent+rope bf16", "mla_fp8": "MLA fp8 (fp8_ds_mla)",
              "indexer_bf16": "indexer keys bf16", "indexer_fp8": "indexer keys fp8+scale"}
    for kind, v in cache["per_kind"].items():
        c.add_row(labels[kind], str(v["bytes_per_token_per_layer"]), str(v["bytes_per_token_all"]),
                  fmt_bytes(v["bytes_at_tokens_all"]), fmt_bytes(v["bytes_at_tokens_mtp"]))
    console.print(c)


def info_cmd(
    model: Annotated[str, typer.Argument(help="Profile name, local folder, or Hub repo id (org/name).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document only.")] = False,
    tokens: Annotated[int, typer.Option(help="Context length for the cache totals.")] = 131072,
    revision: Annotated[Optional[str], typer.Option(help="Hub revision (branch, tag or commit).")] = None,
    token: Annotated[Optional[str], typer.Option(help="Hub token for private or gated repos.")] = None,
) -> None:
    """Parameters and bytes per component, active parameters, and cache bytes per token."""
    if tokens <= 0:
        raise UserError(f"--tokens must be positive, got {tokens}")
    cfg, _kind = resolve_config(model, revision=revision, token=token)
    d = info_dict(cfg, tokens=tokens, model=model)
    if json_out:
        print(json.dumps(d, indent=2))
    else:
        _render(d, Console())
