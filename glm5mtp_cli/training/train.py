"""Train a GLM-5 or GLM-5-Next model from scratch, jointly with its MTP layer (`glm5mtp train`).

The family comes from the config's model_type (models.family_of). Everything but the model's
forward is shared: corpus, schedule, optimizer, router balancing, eval, checkpoint, report. A family
contributes a recipe (training/recipes.py): its differentiable training forward (GLM-5: forward_train of its modules;
GLM-5-Next: models/glm5_next/training.py, batched and cache-free), its eval forward and an optional
training-only initialisation. Modules are built by the family (build_target / build_mtp), whose
state_dict keys are the checkpoint's names, so filling, export and parameter counts go by name.

What one step computes, for a batch of windows w[0..T] of the tokenized corpus (x = w[0..T-1]):

    target:  logits[i] predicts w[i+1]                              -> CE_next
    MTP:     row i pairs hidden[i] with embed(x[i+1]), predicts w[i+2] (REFERENCE section 4)
                                                                    -> CE_mtp
    DSA:     every indexer's KL to its layer's dense attention      -> L_idx
    chain:   (GLM-5-Next) the chain's second draft, teacher-forced: row i pairs the MTP's own g[i]
             with embed(x[i+2]), attends what row i attended plus itself, predicts w[i+3]
                                                                    -> CE_chain
    distill: each draft's KL from the target's own distribution for the same token (detached:
             the target is the teacher, not moved by it): KL(p_target[i+1] || p_mtp[i]), and with
             chain KL(p_target[i+2] || p_chain[i])                 -> KL_draft
    loss = CE_next + mtp_weight * CE_mtp + chain_weight * CE_chain + distill_weight * KL_draft
           + indexer_weight * L_idx

CE_chain trains what a draft chain runs: every draft after the first reads the MTP's own g where the
first reads the target's hidden, an input the first-draft loss never shows it (EAGLE-3's
training-time test, one step deep). KL_draft trains what greedy acceptance measures, the
draft's argmax against the target's rather than against the text (self-distillation, as Medusa-2
and EAGLE train their drafters on the target's outputs). The MTP loss flows back into the shared trunk, embeddings and head (DeepSeek-V3's joint MTP
training; weight 0.3). The indexer's inputs are detached inside the model when its loss is
requested, so L_idx trains only the indexers (GLM-5-Next: KL of each pooled indexer to its layer's
dense attention aggregated per pool). Routing uses DeepSeek's aux-loss-free balancing:
after each step every router's `e_score_correction_bias` moves by `bias_gamma * sign(mean load -
expert load)`, computed from the expert ids the MoE records in training mode.

`mtp_only`: the target is loaded from a checkpoint and frozen; only a fresh MTP layer learns.

Schedule: linear warm-up, then cosine to `min_lr_ratio * lr`, driven by progress =
max(step / steps, elapsed / time_budget), so the run ends at whichever comes first with a decayed
learning rate either way. Weights are fp32 masters under bf16 autocast on CUDA; the router runs
outside autocast (fp32), as at inference. The checkpoint is written in the Hub layout through
`write.save_checkpoint` (bf16, `e_score_correction_bias` fp32), with the tokenizer beside it and a
`train_report.json` that says how it was made, all into safe_write's staging folder, created
before any work (an unwritable --out fails at once) and moved into --out only when complete.

On the CPU, CPU_DEFAULTS replace a profile's batch, window and held-out sizes (chosen for CUDA:
glm5-nano's 16 x 2048 needs more than 24 GB there) unless given as flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from glm5mtp_cli.checkpoint.random import fill_random
from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.diagnostics.sizing import model_tensors, tensor_bytes
from glm5mtp_cli.engine.runtime import set_threads
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.safe_write import refuse_overlap, staged_folder
from glm5mtp_cli.training.options import CPU_DEFAULTS, TrainOptions, load_train_config
from glm5mtp_cli.training.recipes import recipe_of
from glm5mtp_cli.training.data import (WindowSampler, _corpus_manifest, _file_sha, default_cache_dir, heldout_windows,
                         prepare_tokenizer, tokenize_split)

# ---- model setup -----------------------------------------------------------------------------------

def _routers_outside_autocast(module: nn.Module, device_type: str) -> None:
    """Run every router in fp32 even under autocast (its own .float() casts are undone by autocast)."""
    from glm5mtp_cli.models.glm5.layers import Router

    for m in module.modules():
        if isinstance(m, Router) and "forward" not in m.__dict__:
            orig = m.forward

            def fwd(*args, _orig=orig, **kwargs):
                with torch.autocast(device_type=device_type, enabled=False):
                    return _orig(*args, **kwargs)

            m.forward = fwd


def _moe_modules(*modules: nn.Module | None) -> list[nn.Module]:
    from glm5mtp_cli.models.glm5.layers import MoE

    return [m for mod in modules if mod is not None for m in mod.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_router_bias(moes: list[nn.Module], gamma: float) -> list[float]:
    """Aux-loss-free balancing: bias += gamma * sign(mean load - load) per expert. Returns each
    MoE's max load / mean load of this step (1.0 is perfectly balanced)."""
    imbalance = []
    for moe in moes:
        ids = getattr(moe, "last_expert_ids", None)
        if ids is None:
            continue
        bias = moe.gate.e_score_correction_bias
        load = torch.bincount(ids.reshape(-1), minlength=bias.numel()).float()
        mean = load.mean()
        if gamma:
            bias.add_(gamma * torch.sign(mean - load))
        imbalance.append(load.max() / mean.clamp_min(1e-9))
        moe.last_expert_ids = None
    return [float(x) for x in torch.stack(imbalance).cpu()] if imbalance else []


def param_groups(modules: list[nn.Module], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for m in modules:
        for name, p in m.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def count_params(cfg) -> dict:
    """Parameter and bf16 byte counts from the family's layout (what the checkpoint holds)."""
    family = family_of(cfg)
    total = mtp = experts = 0
    nbytes = 0
    mtp_prefix = family.mtp_prefix(cfg)
    for name, shape in model_tensors(cfg, with_mtp=True):
        n = math.prod(shape)
        total += n
        nbytes += tensor_bytes(cfg, name, shape, 2)
        if name.startswith(mtp_prefix):
            mtp += n
        if ".mlp.experts." in name:
            experts += n
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": total, "target": total - mtp, "mtp": mtp, "active_per_token": active, "bytes_bf16": nbytes}


def lr_at(step: int, progress: float, base: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


# ---- batches and losses --------------------------------------------------------------------------

def _kl_from(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(teacher) || softmax(student)), the teacher detached."""
    v = student.shape[-1]
    t = teacher.detach().float().reshape(-1, v).log_softmax(-1)
    s = student.float().reshape(-1, v).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def compute_losses(target, mtp, w: torch.Tensor, mtp_only: bool, want_indexer: bool, chain: bool,
                   forward: Callable, distill: bool = False) -> dict[str, torch.Tensor]:
    """Losses of a batch of windows w [B, T+1] (ce_chain 0 without chain, kl_draft 0 without distill)."""
    x = w[:, :-1]
    logits, mtp_logits, aux, chained = forward(target, mtp, x, mtp_only, want_indexer, chain)
    v = logits.shape[-1]
    ce = F.cross_entropy(logits.float().reshape(-1, v), w[:, 1:].reshape(-1))
    ce_mtp = F.cross_entropy(mtp_logits.float().reshape(-1, v), w[:, 2:].reshape(-1))
    ce_chain = (F.cross_entropy(chained.float().reshape(-1, v), w[:, 3:].reshape(-1)) if chained is not None
                else ce.new_zeros(()))
    kl = ce.new_zeros(())
    if distill:
        kl = _kl_from(logits[:, 1:], mtp_logits)
        if chained is not None:
            kl = kl + _kl_from(logits[:, 2:], chained)
    idx = aux.float() if want_indexer else aux.new_zeros(())
    return {"ce": ce, "ce_mtp": ce_mtp, "ce_chain": ce_chain, "kl_draft": kl, "indexer": idx}


@torch.no_grad()
def evaluate(target, mtp, windows: torch.Tensor, batch_size: int, device, autocast,
             forward: Callable) -> dict:
    """Held-out CE of the target and of the MTP head, MTP top-1 accuracy, and the MTP/target
    greedy agreement (how often the draft equals the target's own argmax for the same token:
    the first-draft acceptance of greedy speculation on this text); where the family has a chained
    forward, the same two of the chain's second draft (`chain_ce`, `chain_target_agreement`: its
    argmax against the target's for that token, the first draft teacher-forced)."""
    was = target.training, mtp.training
    target.eval()
    mtp.eval()
    sums = {"ce": 0.0, "ce_mtp": 0.0, "mtp_top1": 0.0, "target_top1": 0.0, "agreement": 0.0,
            "ce_chain": 0.0, "chain_agreement": 0.0}
    n_tok = n_mtp = n_chain = 0
    for i in range(0, len(windows), batch_size):
        w = windows[i:i + batch_size].to(device, non_blocking=True)
        x = w[:, :-1]
        with autocast():
            logits, mtp_logits, chained = forward(target, mtp, x)
        v = logits.shape[-1]
        lt, lm = logits.float(), mtp_logits.float()
        y1, y2 = w[:, 1:], w[:, 2:]
        sums["ce"] += F.cross_entropy(lt.reshape(-1, v), y1.reshape(-1), reduction="sum").item()
        sums["ce_mtp"] += F.cross_entropy(lm.reshape(-1, v), y2.reshape(-1), reduction="sum").item()
        sums["target_top1"] += (lt.argmax(-1) == y1).sum().item()
        sums["mtp_top1"] += (lm.argmax(-1) == y2).sum().item()
        sums["agreement"] += (lm.argmax(-1) == lt[:, 1:].argmax(-1)).sum().item()
        n_tok += y1.numel()
        n_mtp += y2.numel()
        if chained is not None:
            lc = chained.float()
            sums["ce_chain"] += F.cross_entropy(lc.reshape(-1, v), w[:, 3:].reshape(-1), reduction="sum").item()
            sums["chain_agreement"] += (lc.argmax(-1) == lt[:, 2:].argmax(-1)).sum().item()
            n_chain += lc.shape[0] * lc.shape[1]
    target.train(was[0])
    mtp.train(was[1])
    res = {
        "target_ce": sums["ce"] / n_tok, "mtp_ce": sums["ce_mtp"] / n_mtp,
        "target_top1": sums["target_top1"] / n_tok, "mtp_top1": sums["mtp_top1"] / n_mtp,
        "mtp_target_agreement": sums["agreement"] / n_mtp, "tokens": n_tok,
    }
    if n_chain:
        res["chain_ce"] = sums["ce_chain"] / n_chain
        res["chain_target_agreement"] = sums["chain_agreement"] / n_chain
    res["target_ppl"] = math.exp(min(res["target_ce"], 50))
    res["mtp_ppl"] = math.exp(min(res["mtp_ce"], 50))
    return res


# ---- checkpoint ---------------------------------------------------------------------------------

def export_tensors(target: nn.Module, mtp: nn.Module, cfg, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Hub-named tensors of target + MTP (at the family's MTP prefix), bf16 except fp32-stored ones."""
    family = family_of(cfg)
    tensors: dict[str, torch.Tensor] = {}
    prefix = family.mtp_prefix(cfg)
    for name, t in list(target.state_dict().items()) + [(prefix + k, v) for k, v in mtp.state_dict().items()]:
        want = torch.float32 if family.stored_fp32(name) else dtype
        tensors[name] = t.detach().to(device="cpu", dtype=want, copy=True).contiguous()
    expected = dict(family.tensor_shapes(cfg))
    missing, extra = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or extra:
        raise RuntimeError(f"checkpoint names disagree with the layout: missing {sorted(missing)[:5]}, "
                           f"unexpected {sorted(extra)[:5]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise RuntimeError(f"tensor {name} has shape {tuple(tensors[name].shape)}, layout says {shape}")
    return {name: tensors[name] for name in expected}  # checkpoint order


def save_trained(tensors: dict, cfg, out: Path, tok_dir: Path, max_shard_size: int):
    from glm5mtp_cli.checkpoint.write import save_checkpoint

    unquantized = {"quantization_config": None} if hasattr(cfg, "quantization_config") else {}
    cfg = dataclasses.replace(cfg, torch_dtype="bfloat16", **unquantized)
    return save_checkpoint(tensors, cfg, out, max_shard_size=max_shard_size, tokenizer_dir=tok_dir)


# ---- the run ---------------------------------------------------------------------------------------

def _pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA device")
    return dev


def _autocast_factory(device: torch.device, dtype: str):
    import contextlib

    if dtype in ("fp32", "float32"):
        return contextlib.nullcontext
    if dtype in ("bf16", "bfloat16"):
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise UserError(f"--dtype must be bf16 or fp32, got {dtype!r}")


def _cpu_note(opts: TrainOptions) -> str | None:
    """Which CPU_DEFAULTS this run took (the flags not given), for the log."""
    taken = [k for k in CPU_DEFAULTS if getattr(opts, k) is None]
    if not taken:
        return None
    h = opts.hyper
    return (f"on the CPU: {', '.join(f'{k} {h[k]}' for k in taken)} (sized for a small machine; set "
            f"{', '.join('--' + k.replace('_', '-') for k in taken)} to change)")


def _chain_note(ev: dict) -> str:
    if "chain_ce" not in ev:
        return ""
    return f", chained draft ce {ev['chain_ce']:.3f} agreement {ev['chain_target_agreement']:.3f}"


def train(opts: TrainOptions, log: Callable[[str], None] = print, progress_factory=None) -> dict:
    """Run a training job; returns the report (also written to OUT/train_report.json).

    progress_factory(total_steps) -> object with .update(step, fields: dict) and .close(); None = no bar.
    """
    out = Path(opts.out)
    if opts.init is not None:
        refuse_overlap(out, profile_path(str(opts.init)) or opts.init, "--out")  # --init is read until the end
    with staged_folder(out, "--out", opts.force) as tmp:
        return _run(opts, tmp, log, progress_factory)


def _run(opts: TrainOptions, tmp: Path, log: Callable[[str], None], progress_factory) -> dict:
    """train's work, writing into the staging folder `tmp`."""
    t_start = time.time()
    cache = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    device = _pick_device(opts.device)
    if device.type == "cpu":
        set_threads(opts.threads)
    dtype_name = opts.dtype or ("bf16" if device.type == "cuda" else "fp32")
    autocast = _autocast_factory(device, dtype_name)
    torch.manual_seed(opts.seed)

    # Model config, tokenizer, frozen target (mtp-only).
    init_target = None
    if opts.mtp_only:
        if opts.init is None:
            raise UserError("--mtp-only needs --init DIR (the trained target to freeze)")
        from glm5mtp_cli.checkpoint.load import load_models
        from glm5mtp_cli.checkpoint.resolve import resolve_model

        resolved = resolve_model(str(opts.init), need="target", progress=False)
        cfg = resolved.config
        train_section = {}
        config_path = Path(resolved.folder) / "config.json"
        init_target, _, _ = load_models(resolved, device="cpu", dtype=torch.float32)
        if opts.tokenizer is None:
            opts.tokenizer = Path(resolved.folder)
    else:
        if opts.init is not None:
            raise UserError("--init is only used with --mtp-only")
        cfg, train_section, config_path = load_train_config(opts.profile)
    opts.resolve(train_section, on_cpu=device.type == "cpu")
    hp = opts.hyper
    note = _cpu_note(opts) if device.type == "cpu" else None
    if note:
        log(note)
    family = family_of(cfg)
    recipe = recipe_of(cfg)
    if hp["chain_weight"] and not recipe.chain:
        raise UserError(f"--chain-weight: glm5mtp train has no chained-draft loss for the {family.name} family")
    if hp["seq_len"] > cfg.max_position_embeddings:
        raise UserError(f"--seq-len {hp['seq_len']} exceeds max_position_embeddings {cfg.max_position_embeddings}")

    try:
        manifest = _corpus_manifest(opts, cache)
    except ValueError as e:
        raise UserError(f"--corpus-packages: {e}") from None
    extra = "".join(f" + {k} {v}" for k, v in manifest["packages"].items())
    log(f"corpus: Python {manifest['python_version']} stdlib{extra}, {manifest['splits']['train']['files']} train / "
        f"{manifest['splits']['heldout']['files']} held-out files, sha256 {manifest['sha256'][:16]}")
    tok_dir = prepare_tokenizer(opts, cfg.vocab_size, cache, manifest, log)
    train_ids = tokenize_split(tok_dir, "train", cache, manifest, opts, log)
    held_ids = tokenize_split(tok_dir, "heldout", cache, manifest, opts, log)

    # Modules (state_dict keys = checkpoint names, so the random fill goes by name).
    if init_target is not None:
        target = init_target
        target.requires_grad_(False)
    else:
        target = family.build_target(cfg)
        fill_random(target, "", opts.seed)
        if recipe.init is not None:
            recipe.init(target, opts.seed)
    mtp = family.build_mtp(cfg)
    fill_random(mtp, family.mtp_prefix(cfg), opts.seed + 1)
    target.to(device)
    mtp.to(device)
    _routers_outside_autocast(target, device.type)
    _routers_outside_autocast(mtp, device.type)
    target.train(not opts.mtp_only)
    mtp.train()
    trained = [mtp] if opts.mtp_only else [target, mtp]
    moes = _moe_modules(*trained)
    counts = count_params(cfg)
    log(f"model: {counts['total'] / 1e6:.2f} M parameters ({counts['target'] / 1e6:.2f} M target + "
        f"{counts['mtp'] / 1e6:.2f} M MTP; {counts['active_per_token'] / 1e6:.2f} M active per token), "
        f"{counts['bytes_bf16'] / 2**20:.2f} MiB in bf16; device {device}, {dtype_name}")

    fused = device.type == "cuda"
    opt = torch.optim.AdamW(param_groups(trained, hp["weight_decay"]), lr=hp["lr"], betas=(0.9, 0.95),
                            eps=1e-8, fused=fused)
    params = [p for g in opt.param_groups for p in g["params"]]
    sampler = WindowSampler(train_ids, hp["seq_len"], hp["batch_size"], opts.seed)
    windows = heldout_windows(held_ids, hp["seq_len"], hp["eval_tokens"])
    want_indexer = hp["indexer_weight"] > 0 and not opts.mtp_only
    chain = hp["chain_weight"] > 0
    distill = hp["distill_weight"] > 0

    # Loop.
    steps, budget = hp["steps"], hp["time_budget"]
    history: list[dict] = []
    bar = progress_factory(steps) if progress_factory else None
    tokens_seen = 0
    step = 0
    t0 = time.time()
    eval_time = 0.0
    last = {}
    imbalance: list[float] = []
    try:
        while step < steps:
            elapsed = time.time() - t0
            progress = max(step / steps, elapsed / budget if budget else 0.0)
            if progress >= 1.0:
                break
            lr = lr_at(step, progress, hp["lr"], hp["warmup"], hp["min_lr_ratio"])
            for g in opt.param_groups:
                g["lr"] = lr
            w = sampler.next().to(device, non_blocking=True)
            with autocast():
                losses = compute_losses(target, mtp, w, opts.mtp_only, want_indexer, chain, recipe.forward, distill)
            later = hp["chain_weight"] * losses["ce_chain"] + hp["distill_weight"] * losses["kl_draft"]
            if opts.mtp_only:
                loss = losses["ce_mtp"] + later
            else:
                loss = (losses["ce"] + hp["mtp_weight"] * losses["ce_mtp"] + later
                        + hp["indexer_weight"] * losses["indexer"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, hp["grad_clip"])
            opt.step()
            imbalance = update_router_bias(moes, hp["bias_gamma"])
            step += 1
            tokens_seen += w.shape[0] * (w.shape[1] - 1)
            last = {"loss": loss.item(), "ce": losses["ce"].item(), "ce_mtp": losses["ce_mtp"].item(),
                    "ce_chain": losses["ce_chain"].item(), "kl_draft": losses["kl_draft"].item(), "indexer": losses["indexer"].item(), "lr": lr,
                    "grad_norm": float(gnorm)}
            if not math.isfinite(last["loss"]):
                raise RuntimeError(f"loss became {last['loss']} at step {step}; try a lower --lr")
            train_s = time.time() - t0 - eval_time
            last["tok_s"] = tokens_seen / max(train_s, 1e-9)
            if bar is not None:
                bar.update(step, last)
            if step % hp["eval_every"] == 0 and step < steps:
                te = time.time()
                ev = evaluate(target, mtp, windows, hp["batch_size"], device, autocast, recipe.eval_forward)
                eval_time += time.time() - te
                history.append({"step": step, "elapsed_s": round(time.time() - t0, 1), "train": dict(last),
                                "heldout": ev, "expert_max_over_mean": imbalance})
                log(f"step {step}: train loss {last['loss']:.3f} (ce {last['ce']:.3f}, mtp {last['ce_mtp']:.3f}, "
                    f"idx {last['indexer']:.3f}); held-out ce {ev['target_ce']:.3f}, mtp ce {ev['mtp_ce']:.3f}, "
                    f"agreement {ev['mtp_target_agreement']:.3f}{_chain_note(ev)}; {last['tok_s']:,.0f} tok/s")
    finally:
        if bar is not None:
            bar.close()
    train_wall = time.time() - t0
    if step == 0:
        raise UserError("no training step ran (time budget too small?)")

    final = evaluate(target, mtp, windows, hp["batch_size"], device, autocast, recipe.eval_forward)
    log(f"held-out after {step} steps: target ce {final['target_ce']:.3f} (ppl {final['target_ppl']:.1f}), "
        f"MTP ce {final['mtp_ce']:.3f} (ppl {final['mtp_ppl']:.1f}), MTP/target agreement "
        f"{final['mtp_target_agreement']:.3f}{_chain_note(final)}")

    tensors = export_tensors(target, mtp, cfg)
    summary = save_trained(tensors, cfg, tmp, tok_dir, opts.max_shard_size)
    stopped_by = "steps" if step >= steps else "time_budget"
    report = {
        "command": opts.command or " ".join(shlex.quote(a) for a in sys.argv),
        "mode": "mtp_only" if opts.mtp_only else "joint",
        "init": str(opts.init) if opts.init else None,
        "config": str(config_path),
        "seed": opts.seed,
        "hyperparameters": hp,
        "steps_planned": steps,
        "steps_done": step,
        "stopped_by": stopped_by,
        "tokens_seen": tokens_seen,
        "epochs_of_train_split": tokens_seen / len(train_ids),
        "train_tokens": int(len(train_ids)),
        "heldout_tokens_evaluated": final["tokens"],
        "train_wall_s": round(train_wall, 1),
        "eval_wall_s": round(eval_time, 1),
        "total_wall_s": round(time.time() - t_start, 1),
        "tokens_per_s": round(tokens_seen / max(train_wall - eval_time, 1e-9), 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "dtype": dtype_name,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "corpus": manifest,
        "tokenizer": {"vocab_size": cfg.vocab_size, "sha256": _file_sha(tok_dir / "tokenizer.json")},
        "parameters": counts,
        "checkpoint": {"files": summary.files, "tensors": summary.tensors, "bytes": summary.total_bytes},
        "final_train": last,
        "expert_max_over_mean_last_step": imbalance,
        "heldout": final,
        "history": history,
    }
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
