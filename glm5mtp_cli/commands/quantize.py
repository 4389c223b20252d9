"""`glm5mtp quantize SRC OUT_DIR`: an FP8 copy of a checkpoint (or, with --dequantize, the fp32 twin of an FP8 one)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.units import fmt_bytes


def quantize_cmd(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Profile name (e.g. glm5-nano), folder or Hub id with weights.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Folder to write the checkpoint into.")],
    dequantize: Annotated[bool, typer.Option("--dequantize", metavar="", help="Write the fp32 twin of an FP8 "
                                             "checkpoint (its weights dequantized) instead.")] = False,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", metavar="SIZE", help="Largest shard, e.g. 5GB, 500MB.")] = "5GB",
    force: Annotated[bool, typer.Option("--force", metavar="", help="Overwrite a folder that already holds a checkpoint.")] = False,
) -> None:
    """Quantize a checkpoint's matrices to FP8 e4m3 with 128x128 block scales (the tensors its family's
    official FP8 checkpoint quantizes: GLM-5-FP8's, GLM-5-Next-FP8's).

    Examples:

      glm5mtp quantize glm5-nano /tmp/nano-fp8

      glm5mtp quantize glm5next-nano /tmp/next-nano-fp8

      glm5mtp quantize /tmp/nano-fp8 /tmp/nano-fp8-twin --dequantize    (its fp32 twin)
    """
    from glm5mtp_cli.checkpoint.write import parse_size, rewrite_checkpoint

    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output '{out_dir}' exists and is not a folder")
    if out_dir.is_dir() and ((out_dir / "config.json").exists() or any(out_dir.glob("*.safetensors"))) and not force:
        raise UserError(f"output folder '{out_dir}' already holds a checkpoint; pass --force to overwrite it")
    summary = rewrite_checkpoint(src, out_dir, fp8=not dequantize, max_shard_size=parse_size(max_shard_size))
    Console().print(f"{'fp32 twin' if dequantize else 'fp8 (e4m3, 128x128 blocks)'} of {src} -> {summary.out_dir}: "
                    f"{summary.tensors} tensors, {len(summary.files)} files, {fmt_bytes(summary.total_bytes)}")
