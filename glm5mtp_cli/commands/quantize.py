"""`glm5mtp quantize SRC OUT_DIR`: an FP8 copy of a checkpoint (or, with --dequantize, the fp32 twin of an FP8 one)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from glm5mtp_cli.safe_write import check_room, refuse_overlap, staged_folder
from glm5mtp_cli.units import fmt_bytes, plural


def quantize_cmd(
    src: Annotated[str, typer.Argument(metavar="SRC", help="Profile name (e.g. glm5-nano), folder or Hub id with weights.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="Folder to write the checkpoint into.")],
    dequantize: Annotated[bool, typer.Option("--dequantize", metavar="", help="Write the fp32 twin of an FP8 "
                                             "checkpoint (its weights dequantized) instead.")] = False,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", metavar="SIZE", help="Largest shard, e.g. 5GB, 500MB.")] = "5GB",
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace the checkpoint a folder already "
                                        "holds (once the new one is complete).")] = False,
) -> None:
    """Quantize a checkpoint's matrices to FP8 e4m3 with 128x128 block scales (the tensors its family's
    official FP8 checkpoint quantizes: GLM-5-FP8's, GLM-5-Next-FP8's). Tokenizer files and
    token_counts.json come along. Written into a hidden folder beside OUT_DIR that takes its place
    when complete; OUT_DIR must not be, contain or lie inside SRC's folder.

    Examples:

      glm5mtp quantize glm5-nano /tmp/nano-fp8

      glm5mtp quantize glm5next-nano /tmp/next-nano-fp8

      # its fp32 twin
      glm5mtp quantize /tmp/nano-fp8 /tmp/nano-fp8-twin --dequantize
    """
    from glm5mtp_cli.checkpoint.resolve import profile_path
    from glm5mtp_cli.checkpoint.write import parse_size, rewrite_bytes, rewrite_checkpoint, rewrite_source

    shard_size = parse_size(max_shard_size, "--max-shard-size")
    source = profile_path(src) or Path(src).expanduser()
    if source.is_dir():  # else a Hub id, read from the Hub cache
        refuse_overlap(out_dir, source, "OUT_DIR")
    fp8 = not dequantize
    with staged_folder(out_dir, "OUT_DIR", force) as tmp:
        resolved = rewrite_source(src, fp8)
        size = rewrite_bytes(resolved, fp8)
        check_room(out_dir, size, "OUT_DIR")
        Console(stderr=True).print(f"{'quantize' if fp8 else 'dequantize'}: writing {fmt_bytes(size)} of weights "
                                   f"into {out_dir}", highlight=False, soft_wrap=True)
        summary = rewrite_checkpoint(resolved, tmp, fp8, max_shard_size=shard_size, progress=True)
    Console().print(f"{'fp32 twin' if dequantize else 'fp8 (e4m3, 128x128 blocks)'} of {src} -> {out_dir}: "
                    f"{plural(summary.tensors, 'tensor')}, {plural(len(summary.files), 'file')}, "
                    f"{fmt_bytes(summary.total_bytes)}")
