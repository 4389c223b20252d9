"""Flags shared by several commands, as `Annotated` aliases (one wording everywhere), and the help panels
that group every command's flags.

Nothing here imports torch: `glm5mtp CMD --help` builds its help from these and the command's signature
alone; a command imports the engine inside its body, when it runs.

Help at 80 columns: Typer lays each panel out as one table whose option, negative-flag and metavar
columns are as wide as the panel's longest entry, and the help column gets what is left; so flags
are grouped into panels (a long name or metavar widens only its own panel) and metavars are short
words, the values they take listed in the help text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

import profiles
from glm5mtp_cli.engine.config import DEFAULT_MODEL  # noqa: F401  (torch-free: the commands' defaults)
from glm5mtp_cli.errors import UserError

# Help panels, in the order commands mostly meet them; a command's main inputs stay in Typer's
# default "Options" panel, beside --help.
MODEL = "Model and device"
SPECULATION = "Speculation"
SAMPLING = "Sampling"
BATCHING = "Batching and memory"
GRAPHS = "CUDA graphs"
COMPILE = "Compile"
GLM5NEXT = "GLM-5-Next"
CONVERSATION = "Conversation"
CONSTRAINT = "Constraint"
OUTPUT = "Output"

ModelOpt = Annotated[str, typer.Option("--model", "-m", metavar="NAME", rich_help_panel=MODEL,
                                       help=f"Profile ({', '.join(profiles.names())}), local folder or Hub repo "
                                            "id.")]
DeviceOpt = Annotated[str, typer.Option("--device", metavar="DEVICE", rich_help_panel=MODEL,
                                        help="cpu, cuda, cuda:N or auto (cuda when available).")]
DtypeOpt = Annotated[str, typer.Option("--dtype", metavar="DTYPE", rich_help_panel=MODEL,
                                       help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp16.")]
LayersOpt = Annotated[Optional[int], typer.Option("--layers", metavar="K", rich_help_panel=MODEL,
                                                  help="Use only the first K target layers.")]
JsonOpt = Annotated[bool, typer.Option("--json", metavar="", rich_help_panel=OUTPUT,
                                       help="One JSON document on stdout, nothing else there (progress and notes go "
                                            "to stderr).")]
TpOpt = Annotated[int, typer.Option("--tp", metavar="N", rich_help_panel=MODEL,
                                    help="Tensor/expert parallel ranks (one GPU each; gloo processes on the CPU). "
                                         "Started by the command itself, or by torchrun.")]
RandomWeightsOpt = Annotated[bool, typer.Option("--random-weights", metavar="", rich_help_panel=MODEL,
                                                help="Random weights of the model's config, built on the device, each "
                                                     "rank its own slices under --tp (real dimensions without a "
                                                     "checkpoint, e.g. --model glm5 --layers 4).")]
Fp8Opt = Annotated[bool, typer.Option("--fp8", metavar="", rich_help_panel=MODEL,
                                      help="With --random-weights: the family's FP8 layout as GLM-5-FP8 stores it "
                                           "(e4m3, 128x128 block scales; lm_head bf16), kept FP8.")]


ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", metavar="N", rich_help_panel=MODEL,
    help="CPU threads for torch (default: OMP_NUM_THREADS if set, else half the cores, at most 4: torch's own "
         "default, every core, collapses when another process is busy).")]
CudaGraphsOpt = Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs", metavar="", rich_help_panel=GRAPHS,
                                             help="On CUDA (one device, or every rank under --tp), replay decode, "
                                                  "verify and draft forwards as CUDA graphs (ignored on the CPU).")]
MtpIndexShareOpt = Annotated[Optional[bool], typer.Option(
    "--mtp-index-share/--no-mtp-index-share", metavar="", rich_help_panel=GLM5NEXT,
    help="Chained draft steps reuse the pool top-k of the propose's first draft row (on) or score their own "
         "(off). Default: the model config's choice.")]
CompileOpt = Annotated[Optional[str], typer.Option(
    "--compile", metavar="MODE", rich_help_panel=COMPILE,
    help="Compile the decode, verify and draft forwards with torch.compile before their capture: kernels (the "
         "Triton kernels as custom ops, inductor fuses the rest), torch (the pure-PyTorch path compiled whole), "
         "off. Default: the model family's (off). Compile time is reported apart (compile_s).")]
CompileModeOpt = Annotated[str, typer.Option("--compile-mode", metavar="MODE", rich_help_panel=COMPILE,
                                             help="inductor's mode for --compile: default or "
                                                  "max-autotune-no-cudagraphs.")]
# On/off flags pass metavar="" so that help shows no "<bool>" beside them.

PromptOpt = Annotated[Optional[str], typer.Option("--prompt", metavar="TEXT",
                                                  help="Prompt text (needs the checkpoint's tokenizer).")]
PromptIdsOpt = Annotated[Optional[str], typer.Option("--prompt-ids", metavar="IDS",
                                                     help="Comma-separated token ids, e.g. 3,17,99.")]
ScheduleOpt = Annotated[str, typer.Option("--schedule", metavar="NAME", rich_help_panel=BATCHING,
                                          help="continuous: a finished request's slot goes to the next waiting one "
                                               "between decode steps; static: the next requests start only when the "
                                               "whole batch has finished (for comparison).")]
PrefillTokensOpt = Annotated[int, typer.Option("--prefill-tokens", metavar="N", rich_help_panel=BATCHING,
                                               help="Prompt tokens admitted together, whose prompts share prefill "
                                                    "forwards (also the most rows one prefill forward holds).")]
PrefillGraphsOpt = Annotated[bool, typer.Option("--prefill-graphs", metavar="", rich_help_panel=GRAPHS,
                                                help="Run the admission prefill's forwards (target and drafter) from "
                                                     "CUDA graphs, one per (sequences, rows) bucket up to 16384 rows "
                                                     "(fewer for models wider than 768), captured at its first use; "
                                                     "needs CUDA graphs.")]


GammaPolicyOpt = Annotated[str, typer.Option("--gamma-policy", metavar="NAME", rich_help_panel=SPECULATION,
                                             help="fixed: every step drafts --gamma; adaptive: each step drafts "
                                                  "0..--gamma, whatever the rolling acceptance and the measured "
                                                  "step costs predict to be fastest (output unchanged).")]


SyntheticOpt = Annotated[Optional[str], typer.Option(
    "--synthetic-acceptance", metavar="P1,P2,...", rich_help_panel=SPECULATION,
    help="Synthetic: accept draft k with probability Pk given drafts 1..k-1 were (the last P for later "
         "drafts), whatever the models say, then emit the target's token: times speculation at a chosen "
         "acceptance (e.g. on --random-weights); the output is not the target's.")]


def synthetic_rates(text: str | None) -> tuple[float, ...] | None:
    """--synthetic-acceptance's rates (engine/synthetic.py parses them: imported here when given)."""
    if text is None:
        return None
    from glm5mtp_cli.engine.synthetic import parse_rates

    return parse_rates(text)



JsonSchemaOpt = Annotated[Optional[Path], typer.Option("--json-schema", metavar="FILE", rich_help_panel=CONSTRAINT,
                                                       help="Every reply matches this JSON schema (a prompt line's "
                                                            "own response_format replaces it).")]
JsonObjectOpt = Annotated[bool, typer.Option("--json-object", metavar="", rich_help_panel=CONSTRAINT,
                                             help="Every reply is one JSON object (another JSON value: "
                                                  "--json-schema).")]
RegexOpt = Annotated[Optional[str], typer.Option("--regex", metavar="PATTERN", rich_help_panel=CONSTRAINT,
                                                 help="Every reply matches this regex (whole).")]
GrammarOpt = Annotated[Optional[Path], typer.Option("--grammar", metavar="FILE", rich_help_panel=CONSTRAINT,
                                                    help="Every reply matches this Lark grammar (llguidance's "
                                                         "syntax).")]
ConstrainAfterOpt = Annotated[Optional[str], typer.Option(
    "--constrain-after", metavar="TOKEN", rich_help_panel=CONSTRAINT,
    help="Unconstrained until this token (one token of the vocabulary, e.g. </think>, or id:N) is emitted; "
         "constrained from the next position.")]
DraftMaskOpt = Annotated[bool, typer.Option(
    "--draft-mask/--no-draft-mask", metavar="", rich_help_panel=CONSTRAINT,
    help="Mask the drafter's logits by the grammar too (one host read per draft position); off: drafts "
         "unconstrained, only the verify is masked.")]


def constraint_flags(json_schema, json_object: bool, regex, grammar, constrain_after, draft_mask: bool,
                     items, folder, vocab_size: int, synthetic: bool, tp: int = 1) -> dict:
    """The EngineConfig fields of the constraint flags, every constraint (the flags' and the prompt
    lines') checked before any weights load. folder: the checkpoint's, if local (its tokenizer)."""
    from glm5mtp_cli.constraint import check_run, from_flags, trigger_id

    c = from_flags(json_schema, json_object, regex, grammar)
    constrained = c is not None or any(p.constraint is not None for p in items or [])
    tokenizer = folder / "tokenizer.json" if folder is not None else None
    check_run(constrained, synthetic, tp, tokenizer is None or tokenizer.is_file())
    if constrain_after is not None and not constrained:
        raise UserError("--constrain-after needs a constraint (--json-schema, --json-object, --regex, --grammar "
                        "or a prompt line's response_format)")
    after = trigger_id(constrain_after, tokenizer, vocab_size) if constrain_after is not None else None
    return {"constraint": c, "constrain_after": after, "draft_mask": draft_mask}
