"""Write checkpoints in exactly the Hub layout, shard by shard, and make random ones (init-random,
with checkpoint.random's initialiser).

Memory rule: at most one shard's worth of tensors (plus the tensor being made) is held at a time,
so a full-width GLM-5 with a few layers can be written on a small machine.

These functions write into a new or empty folder; the commands give them safe_write's staging
folder, which moves into place only once the checkpoint is complete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch

from glm5mtp_cli.checkpoint.random import random_tensor
from kernels.fp8_block import fp8_block_quantize
from glm5mtp_cli.checkpoint.resolve import INDEX_FILE, SINGLE_FILE, ResolvedModel, config_from_spec
from glm5mtp_cli.engine.draft_vocab import COUNTS_FILE, counts_file
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models.fp8 import FP8_QUANT_CONFIG
from glm5mtp_cli.models.glm5.config import ModelConfig
from glm5mtp_cli.safe_write import default_mode
from glm5mtp_cli.units import parse_size

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}
_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
TOKENIZER_FILES = re.compile(r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\..*|merges\.txt|chat_template.*)$")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"dtype '{name}' not supported: use bf16, fp16 or fp32") from None


# ---- FP8 --------------------------------------------------------------------------------------------

def _maybe_quantize(family, cfg, name: str, t: torch.Tensor, block) -> Iterator[tuple[str, torch.Tensor]]:
    if family.is_fp8_quantized(cfg, name, tuple(t.shape)) and t.dtype != torch.float8_e4m3fn:
        q, s = fp8_block_quantize(t, block)
        yield name, q
        yield name + "_scale_inv", s
    else:
        yield name, t


# ---- writing ------------------------------------------------------------------------------------------

@dataclass
class WriteSummary:
    out_dir: Path
    files: list[str]
    tensors: int
    total_bytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_checkpoint(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                    out_dir: str | os.PathLike, max_shard_size: int | str = "5GB", fp8: bool = False,
                    tokenizer_dir: str | os.PathLike | None = None) -> WriteSummary:
    """Write `tensors` as a Hub-layout checkpoint into the new or empty folder `out_dir`:
    config.json, generation_config.json, and either one model.safetensors or
    model-0000i-of-0000K.safetensors shards plus the index.

    `tensors` may be a generator: shards are flushed as they fill, so memory stays about one shard.
    With fp8, the weights REFERENCE.md lists as quantized become float8_e4m3fn + `_scale_inv`.
    """
    from safetensors.torch import save_file

    tok_files = tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []  # fail before writing
    family = family_of(config)
    config_json = family.config_dict(config, dict(FP8_QUANT_CONFIG) if fp8 else None)  # refuses before writing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):  # a reader trusts the index: old shards would mix with the new
        raise ValueError(f"{out} holds weights already; write into a new folder (safe_write.staged_folder)")
    limit = parse_size(max_shard_size)
    block = tuple(FP8_QUANT_CONFIG["weight_block_size"])
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    temp_files: list[str] = []
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        name = f".partial-{len(temp_files):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        temp_files.append(name)
        shard, shard_bytes = {}, 0

    for name, t in items:
        for n, q in _maybe_quantize(family, config, name, t, block) if fp8 else ((name, t),):
            if n in weight_map or n in shard:
                raise ValueError(f"tensor '{n}' given twice")
            size = _nbytes(q)
            if shard and shard_bytes + size > limit:
                flush()
            shard[n] = q.detach().contiguous().cpu()
            weight_map[n] = str(len(temp_files))  # the shard number; renamed below
            shard_bytes += size
            total += size
    flush()
    files = _finalize_shards(out, temp_files, weight_map, total)
    _write_configs(out, config, config_json)
    for f in tok_files:
        shutil.copyfile(Path(tokenizer_dir) / f, out / f)
    return WriteSummary(out, files, len(weight_map), total)


def _finalize_shards(out: Path, temp_files: list[str], weight_map: dict[str, str], total: int) -> list[str]:
    """Rename the temp shards now that their count is known; write the index when there are several."""
    k = len(temp_files)
    names = [SINGLE_FILE] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    mode = default_mode(folder=False)
    for tmp, final in zip(temp_files, names):
        os.chmod(out / tmp, mode)  # safetensors writes 0600; a checkpoint is shared like any other file
        os.replace(out / tmp, out / final)
    if k > 1:
        wm = {n: names[int(i)] for n, i in sorted(weight_map.items())}
        index = {"metadata": {"total_size": total}, "weight_map": wm}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names if k else []


def _write_configs(out: Path, cfg, config_json: dict) -> None:
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    gen = {"_from_model_config": True, "eos_token_id": list(cfg.eos_token_id)}
    if getattr(cfg, "bos_token_id", None) is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    if cfg.pad_token_id is not None:
        gen["pad_token_id"] = cfg.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def tokenizer_files(src: str | os.PathLike) -> list[str]:
    """The tokenizer files to copy from `src` (tokenizer.json, tokenizer_config.json, ...)."""
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"tokenizer folder '{src}' not found")
    files = sorted(p.name for p in src.iterdir() if p.is_file() and TOKENIZER_FILES.match(p.name))
    if not files:
        raise UserError(f"tokenizer folder '{src}' holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    return files


def _tracked(items: Iterable[tuple[str, torch.Tensor]], total: int, label: str,
             show: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` passed through, with a Rich bar on stderr over their elements when `show` and
    stderr is a terminal (a real GLM-5 layer takes minutes to write)."""
    if not show:
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)
        for name, t in items:
            yield name, t
            bar.advance(task, t.numel())


# ---- random checkpoints --------------------------------------------------------------------------------

def random_tensors(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of target + MTP, made one at a time in checkpoint order."""
    for name, shape in family_of(cfg).tensor_shapes(cfg):
        yield name, random_tensor(name, shape, seed, dtype)


def random_config(profile_or_config: str | os.PathLike | ModelConfig, dtype: torch.dtype | str | None = None,
                  layers: int | None = None) -> tuple[ModelConfig, torch.dtype]:
    """The config init-random writes (--layers applied, torch_dtype set to `dtype`, default the config's)
    and that dtype."""
    cfg = config_from_spec(profile_or_config) if isinstance(profile_or_config, (str, os.PathLike)) else profile_or_config
    if layers is not None:
        cfg = cfg.with_layers(layers)
    if dtype is None:
        dtype = cfg.torch_dtype
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    return dataclasses.replace(cfg, torch_dtype=_HF_DTYPE_NAMES[dtype]), dtype


def _fp8_bytes(shape: tuple[int, ...]) -> int:
    """A matrix's bytes in FP8: one byte an element plus an fp32 scale per 128x128 block."""
    b0, b1 = FP8_QUANT_CONFIG["weight_block_size"]
    return math.prod(shape) + 4 * -(-shape[0] // b0) * -(-shape[1] // b1)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, fp8: bool) -> int:
    """The bytes of the tensors init-random writes for `cfg` (WriteSummary.total_bytes), from the shapes
    alone: with fp8, the FP8 matrices at _fp8_bytes."""
    family = family_of(cfg)
    total = 0
    for name, shape in family.tensor_shapes(cfg):
        if fp8 and family.is_fp8_quantized(cfg, name, tuple(shape)):
            total += _fp8_bytes(tuple(shape))
        else:
            total += math.prod(shape) * dtype.itemsize
    return total


def init_random(profile_or_config: str | os.PathLike | ModelConfig, out_dir: str | os.PathLike, seed: int = 0,
                dtype: torch.dtype | str | None = None, fp8: bool = False, layers: int | None = None,
                max_shard_size: int | str = "5GB", tokenizer: str | os.PathLike | None = None,
                progress: bool = False) -> WriteSummary:
    """A random target (layers 0..L-1) plus its MTP layer at model.layers.{L}, L after --layers.
    progress: a bar on stderr (when it is a terminal)."""
    cfg, dtype = random_config(profile_or_config, dtype, layers)
    total = sum(math.prod(shape) for _, shape in family_of(cfg).tensor_shapes(cfg))
    tensors = _tracked(random_tensors(cfg, seed, dtype), total, "init-random", progress)
    try:
        return save_checkpoint(tensors, cfg, out_dir, max_shard_size=max_shard_size, fp8=fp8, tokenizer_dir=tokenizer)
    finally:
        tensors.close()  # stops the bar now, not when the garbage collector finds it after an error


# ---- FP8 checkpoints from existing ones, and their dequantized twins ----------------------------------

def rewrite_source(src: str, fp8: bool) -> ResolvedModel:
    """`src` (a profile name, folder or Hub id with weights) resolved for rewrite_checkpoint; refused
    when it has no weights or, with fp8, is FP8 already."""
    from glm5mtp_cli.checkpoint.resolve import resolve_model

    resolved = resolve_model(src, progress=False)
    if not resolved.has_weights:
        raise UserError(f"model '{src}' has no weights to rewrite")
    if fp8 and getattr(resolved.config, "fp8", False):
        raise UserError(f"model '{src}' is already FP8 (its config has an fp8 quantization_config)")
    return resolved


def _source_reader(resolved: ResolvedModel):
    from glm5mtp_cli.checkpoint.read import CheckpointReader

    block = getattr(resolved.config, "fp8_block", (128, 128))
    return CheckpointReader(resolved.folder, resolved.weight_map, block=block)


def _rewritten_names(resolved: ResolvedModel) -> list[str]:
    """The tensors rewrite_checkpoint reads: each weight, its FP8 scales read with it."""
    return [n for n in resolved.weight_map if not n.endswith("_scale_inv")]


def rewrite_bytes(resolved: ResolvedModel, fp8: bool) -> int:
    """The bytes of the tensors rewrite_checkpoint writes from `resolved` (WriteSummary.total_bytes), from
    the shards' headers alone: with fp8, the family's FP8 matrices at _fp8_bytes and the rest as read
    (an FP8 tensor dequantized: fp32); without, every tensor in fp32."""
    cfg = resolved.config
    family = family_of(cfg)
    reader = _source_reader(resolved)
    total = 0
    try:
        for name in _rewritten_names(resolved):
            shape = reader.shape(name)
            if not fp8:
                total += math.prod(shape) * 4
            elif family.is_fp8_quantized(cfg, name, shape):
                total += _fp8_bytes(shape)
            else:
                total += math.prod(shape) * (4 if reader.stored_fp8(name) else reader.stored_itemsize(name))
    finally:
        reader.close()
    return total


def rewrite_checkpoint(src: str | ResolvedModel, out_dir: str | os.PathLike, fp8: bool,
                       max_shard_size: int | str = "5GB", progress: bool = False) -> WriteSummary:
    """`src` (a profile name, folder or Hub id with weights, or rewrite_source's resolution of one)
    rewritten into `out_dir`, one tensor at a time: with fp8, quantized to float8_e4m3fn + 128x128
    block scales (what the family's layout quantizes; the rest as stored); without, every tensor in
    fp32 and FP8 ones dequantized (the unquantized twin of an FP8 checkpoint: the weights its FP8 run
    computes with). Tokenizer files and the draft-vocab counts (the tokenizer's, so they hold for the
    copy) come along. progress: a bar on stderr (when it is a terminal)."""
    resolved = rewrite_source(src, fp8) if isinstance(src, str) else src
    cfg = resolved.config
    reader = _source_reader(resolved)
    names = _rewritten_names(resolved)
    dtype = None if fp8 else torch.float32
    out_cfg = cfg if fp8 else dataclasses.replace(cfg, torch_dtype="float32", quantization_config=None)
    has_tok = any(TOKENIZER_FILES.match(p.name) for p in Path(resolved.folder).iterdir())
    total = sum(math.prod(reader.shape(n)) for n in names)
    tensors = _tracked(((n, reader.get(n, dtype)) for n in names), total, "quantize" if fp8 else "dequantize",
                       progress)
    try:
        summary = save_checkpoint(tensors, out_cfg, out_dir, max_shard_size=max_shard_size, fp8=fp8,
                                  tokenizer_dir=resolved.folder if has_tok else None)
    finally:
        tensors.close()
        reader.close()
    counts = counts_file(Path(resolved.folder))
    if counts is not None:
        shutil.copyfile(counts, Path(out_dir) / COUNTS_FILE)
    return summary
