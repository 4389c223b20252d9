"""The two objects a run is decided by: which model to load (`ModelSpec`) and how the engine runs
it (`EngineConfig`). A command builds them from its flags, each validated here and nowhere else,
then passes them whole: to the loader, to the engine, to its ranks under --tp (they serialise),
and into `--json` (`to_json`).

No torch here: commands build and check their configs before anything heavy is imported, so a bad
flag costs no import and no weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from glm5mtp_cli.constraint import Constraint
from glm5mtp_cli.errors import UserError

DEFAULT_MODEL = "glm5-nano"
DTYPES = ("auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16")
ALLOCS = ("budget", "ceiling")
SCHEDULES = ("continuous", "static")
GAMMA_POLICIES = ("fixed", "adaptive")
# auto: CUDA graphs where the device and the model allow (--cuda-graphs); off: none (--no-cuda-graphs);
# eager, static, cuda: that forward mode exactly (engine/graphs.py; tests and diagnostics)
GRAPHS = ("auto", "off", "eager", "static", "cuda")
COMPILES = ("off", "kernels", "torch")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
MAX_GAMMA = 16
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


def check_seed(seed: int) -> None:
    """--seed within what torch.Generator.manual_seed takes (a larger one is an overflow traceback)."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise UserError(f"--seed must be in {SEED_RANGE[0]}..{SEED_RANGE[1]}, got {seed}")


def check_rates(rates: tuple[float, ...], flag: str = "--synthetic-acceptance") -> None:
    """Synthetic acceptance rates (engine/synthetic.py): at least one, each in [0, 1]."""
    if not rates or not all(0.0 <= p <= 1.0 for p in rates):
        raise UserError(f"{flag}: every rate must be in [0, 1], got {','.join(map(str, rates)) or 'none'}")


def _one_of(flag: str, value, choices) -> None:
    if value not in choices:
        raise UserError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class ModelSpec:
    """Which weights, where, in which dtype, over how many ranks."""

    name: str = DEFAULT_MODEL  # a profile, a folder or a Hub id
    device: str = "auto"
    dtype: str = "auto"
    layers: int | None = None  # only the first K target layers
    revision: str | None = None  # Hub revision
    random_weights: bool = False  # the config's shapes with random tensors (checkpoint.RandomReader)
    fp8: bool = False  # with random_weights: the family's FP8 layout, kept FP8
    tp: int = 1
    mtp_index_share: bool | None = None  # GLM-5-Next's index_share_for_mtp_iteration (None: the config's)

    def __post_init__(self):
        if self.fp8 and not self.random_weights:
            raise UserError("--fp8 makes random FP8 weights (with --random-weights); a checkpoint says itself "
                            "whether it is FP8")
        _one_of("--dtype", self.dtype, DTYPES)
        if self.layers is not None and self.layers < 1:
            raise UserError(f"--layers must be >= 1, got {self.layers}")
        if self.tp < 1:
            raise UserError(f"--tp must be >= 1, got {self.tp}")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine generates: drafting, sampling, sizing, scheduling and the forward mode."""

    gamma: int = 3
    gamma_policy: str = "fixed"
    max_new_tokens: int = 64  # per request
    batch_size: int = 1  # slots of the continuous batch
    sampling: SamplingParams = field(default_factory=SamplingParams)
    draft_conf_tau: float | None = None  # stop a draft chain below this top-1 probability
    draft_vocab: int | None = None  # draft over the K most frequent tokens
    draft_vocab_file: str | None = None  # their counts (default: token_counts.json beside the checkpoint)
    max_seq_len: int | None = None  # None: the model's limit (resolved by `for_model`)
    alloc: str = "budget"  # budget: state sized to each request; ceiling: to max_seq_len
    schedule: str = "continuous"
    prefill_chunk: int = 1024  # rows of one prompt per prefill forward
    prefill_tokens: int = 8192  # prompt rows admitted together, and per shared prefill forward
    prefill_graphs: bool = False
    graphs: str = "auto"
    compile: str | None = None  # None: the model family's default (resolved by `for_model`)
    compile_mode: str = "default"
    eos_ids: tuple[int, ...] | None = None  # None: the model's; (): never stop early (--ignore-eos)
    check_invariants: bool = False  # assert drafter rows == accepted rows every step (tests, leak-check)
    synthetic_acceptance: tuple[float, ...] | None = None  # conditional rates per draft (engine/synthetic.py)
    constraint: Constraint | None = None  # every request's (a prompt line's own replaces it): engine/grammar.py
    constrain_after: int | None = None  # token id after which constraints start (--constrain-after)
    draft_mask: bool = True  # mask the drafter's logits too (--no-draft-mask: only the verify's)
    tree: tuple[int, ...] | None = None  # verify a tree of drafts (children per depth, engine/verify.py), not a chain

    def __post_init__(self):
        if not 0 <= self.gamma <= MAX_GAMMA:
            raise UserError(f"--gamma must be in 0..{MAX_GAMMA}, got {self.gamma}")
        _one_of("--gamma-policy", self.gamma_policy, GAMMA_POLICIES)
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {self.batch_size}")
        _one_of("--alloc", self.alloc, ALLOCS)
        _one_of("--schedule", self.schedule, SCHEDULES)
        _one_of("forward mode", self.graphs, GRAPHS)
        if self.compile is not None:
            _one_of("--compile", self.compile, COMPILES)
        _one_of("--compile-mode", self.compile_mode, COMPILE_MODES)
        if self.draft_conf_tau is not None and not 0 <= self.draft_conf_tau <= 1:
            raise UserError(f"--draft-conf-tau must be in [0, 1], got {self.draft_conf_tau}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise UserError(f"--draft-vocab must be >= 1, got {self.draft_vocab}")
        if self.draft_vocab_file is not None and self.draft_vocab is None:
            raise UserError("--draft-vocab-file needs --draft-vocab K")
        if self.draft_vocab_file is not None and not Path(self.draft_vocab_file).is_file():
            raise UserError(f"--draft-vocab-file {self.draft_vocab_file}: no such file")
        if self.synthetic_acceptance is not None:
            check_rates(self.synthetic_acceptance)
        if self.gamma_policy == "adaptive" and self.gamma == 0:
            raise UserError("--gamma-policy adaptive drafts 0..--gamma tokens a step: give --gamma >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise UserError(f"--max-seq-len must be >= 2, got {self.max_seq_len}")
        if self.prefill_tokens < 1:
            raise UserError(f"--prefill-tokens must be >= 1, got {self.prefill_tokens}")
        if self.prefill_chunk < 1:
            raise UserError(f"prefill chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefill_graphs and self.graphs in ("off", "eager"):
            raise UserError("--prefill-graphs replays the prefill from CUDA graphs: it needs --device cuda with "
                            "CUDA graphs on")
        if self.compile not in (None, "off") and self.graphs == "eager":
            raise UserError(f"--compile {self.compile} compiles the static forwards: eager mode has none")
        if self.tree is not None:
            self._check_tree()

    def _check_tree(self) -> None:
        """A tree plan, as yet: greedy, at a fixed gamma (its depth), unconstrained and eager."""
        if any(k < 1 for k in self.tree) or len(self.tree) != self.gamma:
            raise UserError(f"a tree of {len(self.tree)} depths needs --gamma {len(self.tree)} and a child "
                            f"at least per row, got {self.tree} at gamma {self.gamma}")
        if not self.sampling.greedy or self.gamma_policy != "fixed" or self.graphs != "eager":
            raise UserError("a tree of drafts is verified greedily at a fixed gamma in eager mode only, as yet")
        if self.draft_conf_tau is not None or self.synthetic_acceptance is not None or self.constraint is not None:
            raise UserError("a tree of drafts takes no --draft-conf-tau, --synthetic-acceptance or constraint, as yet")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def drafts(self) -> bool:
        """Whether this engine drafts at all (gamma 0 is the target alone)."""
        return self.gamma > 0

    def limit_name(self) -> str:
        """Where max_seq_len came from, in the user's terms (before `for_model` resolves it)."""
        return "--max-seq-len" if self.max_seq_len is not None else "the model's limit (max_position_embeddings)"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

