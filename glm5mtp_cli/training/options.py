"""`glm5mtp train`'s options: the hyperparameters' defaults, a profile's train section and the CPU's
sizes over them, and the train config a profile or file names (training/train.py runs them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5mtp_cli.checkpoint.resolve import profiles_dir
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import parse_config

DEFAULTS: dict[str, Any] = {
    "steps": 2000,
    "batch_size": 32,
    "seq_len": 512,
    "lr": 2e-3,
    "mtp_weight": 0.3,
    "chain_weight": 0.0,
    "distill_weight": 0.0,
    "indexer_weight": 1.0,
    "eval_every": 250,
    "time_budget": None,
    "warmup": None,          # default: min(200, steps // 10)
    "weight_decay": 0.1,
    "min_lr_ratio": 0.1,
    "bias_gamma": 1e-3,
    "grad_clip": 1.0,
    "eval_tokens": 131072,
}
TRAIN_SECTION = "glm5mtp_train"  # optional section of a train config: that profile's defaults
# A smoke run on the CPU: `train --steps 50 --corpus-files 20 --device cpu` peaked at 1.03 GiB RSS
# in 81 s on one thread of a 2-core machine (README, `glm5mtp train`); the profile's 16 x 2048 was
# killed at 24 GB.
CPU_DEFAULTS: dict[str, Any] = {"batch_size": 4, "seq_len": 128, "eval_tokens": 4096}


@dataclass
class TrainOptions:
    out: Path
    profile: str = "glm5-nano"             # profile name, config .json, or a folder holding one
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    seed: int = 0
    device: str | None = None              # default: cuda when available
    threads: int | None = None             # CPU threads (default: engine.runtime.set_threads's)
    dtype: str | None = None               # bf16 (autocast) | fp32; default bf16 on CUDA, fp32 on CPU
    mtp_weight: float | None = None
    chain_weight: float | None = None      # the chained second draft's loss (GLM-5-Next)
    distill_weight: float | None = None    # the drafts' KL from the target's distribution
    indexer_weight: float | None = None
    mtp_only: bool = False
    init: Path | None = None               # with mtp_only: the trained target to freeze
    time_budget: float | None = None       # seconds of training loop
    eval_every: int | None = None
    eval_tokens: int | None = None
    warmup: int | None = None
    weight_decay: float | None = None
    min_lr_ratio: float | None = None
    bias_gamma: float | None = None
    grad_clip: float | None = None
    cache_dir: Path | None = None          # tokenizer + token-id cache (default ~/.cache/glm5mtp/train)
    tokenizer: Path | None = None          # an existing tokenizer folder instead of training one
    corpus_files: int | None = None        # use only the first N files of each split (tests, smoke runs)
    chat_samples: bool = True              # add chat-formatted docstring->function samples to training
    corpus_packages: tuple[str, ...] = ()  # installed packages whose sources join the train split
    max_shard_size: int = 2 * 10**9  # bytes (the command parses --max-shard-size before training)
    force: bool = False
    command: str | None = None             # the command line, for the report
    hyper: dict = field(default_factory=dict)  # resolved hyperparameters (filled by resolve())

    def resolve(self, train_section: dict, on_cpu: bool = False) -> None:
        """Fill `hyper`: explicit option > CPU_DEFAULTS (on the CPU) > the train config's section > DEFAULTS."""
        unknown = set(train_section) - set(DEFAULTS)
        if unknown:
            raise UserError(f"unknown keys in '{TRAIN_SECTION}': {', '.join(sorted(unknown))}")
        h = dict(DEFAULTS)
        h.update(train_section)
        if on_cpu:
            h.update(CPU_DEFAULTS)
        for k in DEFAULTS:
            v = getattr(self, k)
            if v is not None:
                h[k] = v
        if h["warmup"] is None:
            h["warmup"] = min(200, max(1, int(h["steps"]) // 10))
        for k in ("steps", "batch_size", "seq_len", "eval_every", "eval_tokens"):
            if not isinstance(h[k], int) or h[k] <= 0:
                raise UserError(f"--{k.replace('_', '-')} must be a positive integer, got {h[k]!r}")
        if h["seq_len"] < 3:
            raise UserError("--seq-len must be at least 3 (the MTP head predicts two tokens ahead)")
        for k in ("mtp_weight", "chain_weight", "distill_weight", "indexer_weight"):
            if h[k] < 0:
                raise UserError(f"--{k.replace('_', '-')} must not be negative, got {h[k]}")
        if h["lr"] <= 0:
            raise UserError("--lr must be positive")
        if h["time_budget"] is not None and h["time_budget"] <= 0:
            raise UserError("--time-budget must be positive")
        self.hyper = h


def load_train_config(spec: str) -> tuple[Any, dict, Path]:
    """(model config of its family, its train section, the file) for a profile name or a config path.

    A profile is looked up as `profiles/NAME/train_config.json`, then `profiles/NAME/config.json`.
    """
    candidates: list[Path] = []
    if spec and "/" not in spec and "\\" not in spec and not spec.endswith(".json"):
        d = profiles_dir() / spec
        candidates += [d / "train_config.json", d / "config.json"]
    p = Path(spec).expanduser()
    candidates += [p / "train_config.json", p / "config.json"] if p.is_dir() else [p]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise UserError(f"'{spec}' is neither a profile with a train_config.json/config.json nor a config file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    section = raw.pop(TRAIN_SECTION, None) or {}
    if not isinstance(section, dict):
        raise UserError(f"{path}: '{TRAIN_SECTION}' must be an object")
    return parse_config(raw, source=str(path)), section, path
