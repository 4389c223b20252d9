"""`glm5mtp init-random PROFILE OUT_DIR`: a random checkpoint in the Hub layout (target + MTP)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from glm5mtp_cli.safe_write import check_room, staged_folder
from glm5mtp_cli.units import fmt_bytes


def init_random_cmd(
    profile: Annotated[str, typer.Argument(metavar="PROFILE", help="Profile name (e.g. glm5-tiny) or a folder/config.json.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Folder to write the checkpoint into.")],
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same weights).")] = 0,
    dtype: Annotated[Optional[str], typer.Option(help="bf16 | fp16 | fp32 (default: the config's torch_dtype).")] = None,
    fp8: Annotated[bool, typer.Option("--fp8", metavar="", help="Store quantizable weights as FP8 e4m3 with 128x128 block scales.")] = False,
    layers: Annotated[Optional[int], typer.Option(help="Keep only the first K target layers (the MTP layer stays).")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 5GB, 500MB, 64KiB.")] = "5GB",
    tokenizer: Annotated[Optional[Path], typer.Option(help="Copy tokenizer files from this folder.")] = None,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace the checkpoint a folder already "
                                        "holds (once the new one is complete).")] = False,
) -> None:
    """Write random weights for a profile's target and MTP layer, streamed layer by layer into a hidden
    folder beside OUT_DIR that takes its place when complete (Ctrl-C leaves OUT_DIR as it was).

    Examples:

      glm5mtp init-random glm5-tiny /tmp/tiny

      # GLM-5's real shapes, 4 layers
      glm5mtp init-random glm5 /tmp/glm5-4l --layers 4 --fp8
    """
    from glm5mtp_cli.checkpoint.write import init_random, parse_dtype, parse_size, random_config, weight_bytes

    shard_size = parse_size(max_shard_size, "--max-shard-size")
    cfg, dt = random_config(profile, parse_dtype(dtype) if dtype else None, layers)
    size = weight_bytes(cfg, dt, fp8)
    with staged_folder(out_dir, "OUT_DIR", force) as tmp:
        check_room(out_dir, size, "OUT_DIR")
        Console(stderr=True).print(f"init-random: writing {fmt_bytes(size)} of weights into {out_dir}",
                                   highlight=False, soft_wrap=True)
        summary = init_random(cfg, tmp, seed=seed, dtype=dt, fp8=fp8, max_shard_size=shard_size, tokenizer=tokenizer,
                              progress=True)
    table = Table(title=f"init-random {profile} -> {out_dir}", show_header=False)
    table.add_row("weight files", str(len(summary.files)))
    table.add_row("tensors", str(summary.tensors))
    table.add_row("bytes", f"{summary.total_bytes} ({fmt_bytes(summary.total_bytes)})")
    table.add_row("fp8", "yes (e4m3, 128x128 blocks)" if fp8 else "no")
    Console().print(table)
