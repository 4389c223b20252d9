"""`glm5mtp train --out DIR`: train a small GLM-5 or GLM-5-Next (target + MTP layer) on the stdlib corpus."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from glm5mtp_cli.commands.options import MODEL, OUTPUT, ThreadsOpt
from glm5mtp_cli.units import parse_size

# train's own help panels (options.py holds the shared ones)
SCHEDULE = "Optimization"
EVALUATION = "Held-out evaluation"
CORPUS = "Corpus and tokenizer"
SAMPLES = "Chat samples"




class _Bar:
    """A Rich progress bar with the running loss; on a non-terminal, a log line every ~5%."""

    def __init__(self, console: Console, total: int):
        self.console = console
        self.total = total
        self.live = console.is_terminal
        self.every = max(1, total // 20)
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  ce {task.fields[ce]}  mtp {task.fields[mtp]}  "
                       "lr {task.fields[lr]}  {task.fields[tok_s]} tok/s"),
            TimeElapsedColumn(), console=console, disable=not self.live,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, loss="-", ce="-", mtp="-", lr="-", tok_s="-")

    def update(self, step: int, f: dict) -> None:
        fields = {"loss": f"{f['loss']:.3f}", "ce": f"{f['ce']:.3f}", "mtp": f"{f['ce_mtp']:.3f}",
                  "lr": f"{f['lr']:.2e}", "tok_s": f"{f['tok_s']:,.0f}"}
        self.progress.update(self.task, completed=step, **fields)
        if not self.live and (step % self.every == 0 or step == 1):
            self.console.print(f"step {step}/{self.total}  loss {fields['loss']}  ce {fields['ce']}  "
                               f"mtp {fields['mtp']}  lr {fields['lr']}  {fields['tok_s']} tok/s", highlight=False)

    def close(self) -> None:
        self.progress.stop()


def train_cmd(
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Folder to write the trained checkpoint into.")],
    profile: Annotated[str, typer.Option("--profile", "--config", metavar="NAME",
                                         help="Model size: a profile name (its train_config.json) or a config .json.")] = "glm5-nano",
    steps: Annotated[Optional[int], typer.Option("--steps", metavar="N", rich_help_panel=SCHEDULE, help="Optimizer steps (the cosine schedule's length) (default from the profile's train_config.json: glm5-nano 900; else 2000).")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", metavar="N", rich_help_panel=SCHEDULE, help="Sequences per step (default on the CPU 4; else from the profile's train_config.json: glm5-nano 16; else 32).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", metavar="N", rich_help_panel=SCHEDULE, help="Tokens per training sequence (default on the CPU 128; else from the profile's train_config.json: glm5-nano 2048; else 512).")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", metavar="X", rich_help_panel=SCHEDULE, help="Peak learning rate (AdamW) (default from the profile's train_config.json: glm5-nano 0.002; else 0.002).")] = None,
    seed: Annotated[int, typer.Option("--seed", metavar="N", rich_help_panel=SCHEDULE, help="Seed for weights and batches.")] = 0,
    device: Annotated[Optional[str], typer.Option("--device", metavar="DEVICE", rich_help_panel=MODEL, help="cuda | cuda:N | cpu (default: cuda when available).")] = None,
    threads: ThreadsOpt = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPE", rich_help_panel=MODEL, help="bf16 (autocast, fp32 master weights) | fp32; default bf16 on CUDA.")] = None,
    mtp_weight: Annotated[Optional[float], typer.Option("--mtp-weight", metavar="X", rich_help_panel=SCHEDULE, help="Weight of the MTP loss (DeepSeek-V3: 0.3) (default from the profile's train_config.json: glm5-nano 0.3; else 0.3).")] = None,
    chain_weight: Annotated[Optional[float], typer.Option("--chain-weight", metavar="X", rich_help_panel=SCHEDULE, help="Weight of the chained second draft's loss: the MTP fed its own output, as every draft after the first is (GLM-5-Next; default from the profile's train_config.json, else 0: off).")] = None,
    distill_weight: Annotated[Optional[float], typer.Option("--distill-weight", metavar="X", rich_help_panel=SCHEDULE, help="Weight of the drafts' KL from the target's own (detached) distribution for the same token: trains the draft's argmax toward the target's, what greedy acceptance counts (default from the profile's train_config.json, else 0: off).")] = None,
    indexer_weight: Annotated[Optional[float], typer.Option("--indexer-weight", metavar="X", rich_help_panel=SCHEDULE, help="Weight of the DSA indexer KL loss (default from the profile's train_config.json: glm5-nano 1.0; else 1.0).")] = None,
    mtp_only: Annotated[bool, typer.Option("--mtp-only", metavar="", help="Train only a fresh MTP layer against the frozen target from --init.")] = False,
    init: Annotated[Optional[Path], typer.Option("--init", metavar="DIR", help="With --mtp-only: the trained checkpoint whose target is frozen.")] = None,
    time_budget: Annotated[Optional[float], typer.Option("--time-budget", metavar="S", rich_help_panel=SCHEDULE, help="Stop after this many seconds of training (the schedule ends there) (default from the profile's train_config.json: glm5-nano 420; else none).")] = None,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", metavar="N", rich_help_panel=EVALUATION, help="Held-out evaluation every N steps (default from the profile's train_config.json: glm5-nano 200; else 250).")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option("--eval-tokens", metavar="N", rich_help_panel=EVALUATION, help="Held-out tokens per evaluation (default on the CPU 4096; else the train config's, else 131072).")] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", metavar="N", rich_help_panel=SCHEDULE, help="Linear warm-up steps (default min(200, steps/10)).")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", metavar="DIR", rich_help_panel=CORPUS, help="Tokenizer and token-id cache (default ~/.cache/glm5mtp/train).")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option("--tokenizer", metavar="DIR", rich_help_panel=CORPUS, help="Use this tokenizer folder instead of training one.")] = None,
    corpus_files: Annotated[Optional[int], typer.Option("--corpus-files", metavar="N", rich_help_panel=CORPUS, help="Use only the first N files of each split (smoke runs).")] = None,
    chat_samples: Annotated[bool, typer.Option("--chat-samples/--no-chat-samples", metavar="", rich_help_panel=SAMPLES,
                                               help="Add chat-formatted docstring->function samples.")] = True,
    corpus_packages: Annotated[str, typer.Option("--corpus-packages", metavar="LIST", rich_help_panel=CORPUS, help="Comma-separated installed packages whose .py sources join the "
                                                 "train split (e.g. torch,numpy); held-out stays the stdlib's.")] = "",
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", metavar="SIZE", rich_help_panel=OUTPUT, help="Largest safetensors shard.")] = "2GB",
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace the checkpoint a folder already "
                                        "holds (once the new one is complete).")] = False,
) -> None:
    """Train a GLM-5 or GLM-5-Next model (the config's model_type) jointly with its MTP layer; write a Hub-layout checkpoint.

    The checkpoint and train_report.json go into a hidden folder beside --out
    (made before any work) that takes its place when complete; Ctrl-C leaves
    --out as it was.

    Examples:

      # a smoke run: ~1 GB, ~80 s
      glm5mtp train --out /tmp/nano --steps 50 --corpus-files 20 --device cpu

      glm5mtp train --out DIR --profile glm5-nano --time-budget 420 \\
          --device cuda --tokenizer profiles/glm5-nano

      glm5mtp train --out DIR --mtp-only --init profiles/glm5-nano

      glm5mtp train --profile glm5next-nano --out profiles/glm5next-nano \\
          --tokenizer profiles/glm5-nano --device cuda
    """
    from glm5mtp_cli.training.options import TrainOptions
    from glm5mtp_cli.training.train import train

    console = Console(stderr=True)
    opts = TrainOptions(
        out=out, profile=profile, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr, seed=seed,
        device=device, threads=threads, dtype=dtype, mtp_weight=mtp_weight, indexer_weight=indexer_weight,
        chain_weight=chain_weight, distill_weight=distill_weight, mtp_only=mtp_only,
        init=init, time_budget=time_budget, eval_every=eval_every, eval_tokens=eval_tokens, warmup=warmup,
        cache_dir=cache_dir, tokenizer=tokenizer, corpus_files=corpus_files, chat_samples=chat_samples,
        corpus_packages=tuple(p.strip() for p in corpus_packages.split(",") if p.strip()),
        max_shard_size=parse_size(max_shard_size, "--max-shard-size"), force=force,
        command="glm5mtp " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    report = train(opts, log=lambda m: console.print(m, highlight=False),
                   progress_factory=lambda total: _Bar(console, total))
    h = report["heldout"]
    table = Table(title=f"train -> {out}", show_header=False)
    table.add_row("steps", f"{report['steps_done']} / {report['steps_planned']} (stopped by {report['stopped_by']})")
    table.add_row("tokens seen", f"{report['tokens_seen']:,} ({report['epochs_of_train_split']:.2f} epochs)")
    table.add_row("throughput", f"{report['tokens_per_s']:,.0f} tok/s on {report['device']} ({report['dtype']})")
    table.add_row("wall time", f"{report['total_wall_s']:.1f} s (training {report['train_wall_s']:.1f} s)")
    table.add_row("parameters", f"{report['parameters']['total']:,} ({report['parameters']['bytes_bf16'] / 2**20:.2f} MiB bf16)")
    table.add_row("held-out target CE", f"{h['target_ce']:.4f} (ppl {h['target_ppl']:.2f}, top-1 {h['target_top1']:.3f})")
    table.add_row("held-out MTP CE", f"{h['mtp_ce']:.4f} (ppl {h['mtp_ppl']:.2f}, top-1 {h['mtp_top1']:.3f})")
    table.add_row("MTP/target agreement", f"{h['mtp_target_agreement']:.3f}")
    if "chain_ce" in h:
        table.add_row("chained draft", f"CE {h['chain_ce']:.4f}, agreement {h['chain_target_agreement']:.3f}")
    table.add_row("report", str(out / "train_report.json"))
    Console().print(table)
