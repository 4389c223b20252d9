"""Everything a command needs before its loop: device, dtype, loaded models, tokenizer, pools.

Shared by generate, profile, leak-check and bench so they build the same thing the same way.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glm5mtp_cli.engine.cache import CachePools
from glm5mtp_cli.engine.compiled import default_compile
from glm5mtp_cli.engine.config import DEFAULT_MODEL, EngineConfig, ModelSpec  # noqa: F401  (DEFAULT_MODEL: the runtime's default)
from glm5mtp_cli.engine.draft_vocab import load_draft_ids
from glm5mtp_cli.engine.grammar import Grammars
from glm5mtp_cli.engine.memory_check import check_memory
from glm5mtp_cli.engine.mtp_head import mtp_proposer
from glm5mtp_cli.checkpoint.load import load_models
from glm5mtp_cli.checkpoint.resolve import ResolvedModel, as_fp8, resolve_model
from glm5mtp_cli.engine.speculate import SpecEngine
from glm5mtp_cli.engine.target import Target
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.core.family import SLOT

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


def default_threads() -> int:
    """Half the cores this process may use, at least 1, at most 4. torch's own default (every core)
    collapses when another process is busy: on a shared 2-core machine with one busy process, glm5-nano's
    TPOT p50 was 55-78 ms with 2 threads against 7-18 ms with 1 (README, "CPU threads")."""
    return max(1, min(4, usable_cores() // 2))


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """torch's CPU threads: --threads when given, else OMP_NUM_THREADS when set, else default_threads()."""
    if threads is not None:
        cores = usable_cores()
        # more threads than cores only wait for each other (--threads 10000: load average 1362)
        if not 1 <= threads <= cores:
            raise UserError(f"--threads must be in 1..{cores} (the cores this process may use), got {threads}")
        torch.set_num_threads(threads)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(default_threads())
    return torch.get_num_threads()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device (try cpu, cuda, cuda:1, auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: only cpu and cuda are supported")
    return dev


def rank_device(name: str, comm=None) -> torch.device:
    """pick_device, but a rank of --tp (comm, parallel.Comm) on CUDA takes its own GPU, cuda:local_rank,
    made current (its NCCL collectives run there)."""
    dev = pick_device(name)
    if comm is not None and dev.type == "cuda":
        dev = torch.device("cuda", comm.local_rank)
        torch.cuda.set_device(dev)
    return dev


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 on the CPU is slow and rounds differently from the GPU; fp32 keeps CPU runs exact.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]  # a name ModelSpec checked


class Tokenizer:
    """tokenizer.json through the `tokenizers` library, plus the chat template of tokenizer_config.json."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HfTokenizer

        try:
            self.tok = HfTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the library raises its own exception types
            raise UserError(f"{folder / 'tokenizer.json'}: cannot be read ({str(e).splitlines()[0]})") from None
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    @classmethod
    def maybe(cls, folder: Path) -> "Tokenizer | None":
        return cls(folder) if (folder / "tokenizer.json").is_file() else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        template = self.config.get("chat_template")
        if not template:
            raise UserError("--chat: the checkpoint's tokenizer_config.json has no chat_template")
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _template_error
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                     bos_token=self.config.get("bos_token", ""),
                                                     eos_token=self.config.get("eos_token", ""))
        except jinja2.TemplateError as e:
            raise UserError(f"--chat: the chat template failed: {e}") from None


def _template_error(message: str):
    raise UserError(f"chat template: {message}")


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and persistent buffers, each tensor once (tied ones too)."""
    seen: set[int] = set()
    total = 0
    for m in module.modules():
        held = list(m._parameters.values()) + [b for n, b in m._buffers.items() if n not in m._non_persistent_buffers_set]
        for t in held:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@dataclass
class Runtime:
    resolved: ResolvedModel
    cfg: Any  # the family's config object (models.load_config)
    target: Target
    mtp: torch.nn.Module | None
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    comm: object | None = None  # parallel.Comm when sharded over ranks (weights are this rank's)

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the loaded weights: parameters and persistent buffers (FP8 weights and their
        scales are buffers, models/fp8.py; so is the routers' correction bias), as held on this rank."""
        def size(m):
            return module_bytes(m) if m is not None else 0

        emb = self.target.embed_tokens.weight
        head = self.target.lm_head.weight
        return {"target": size(self.target) - emb.numel() * emb.element_size() - head.numel() * head.element_size(),
                "embeddings": emb.numel() * emb.element_size(),
                "lm_head": head.numel() * head.element_size(),
                "mtp_layer": size(self.mtp)}

    @property
    def tp(self) -> int:
        """Ranks the weights are sharded over (1: one device)."""
        return self.comm.world if self.comm is not None else 1

    def make_pools(self, tokens_per_seq: int, concurrent: int, block_size: int = 16,
                   prefill_graphs: bool = False) -> CachePools:
        # + 1: the scratch block a batch's static forwards send padding and retired rows to (graphs.py);
        # + 1 more for the prefill forwards' own (prefill_graphs.py), or a full batch would not fit
        blocks = concurrent * math.ceil(tokens_per_seq / block_size) + 1 + int(prefill_graphs)
        return CachePools.create(self.cfg, blocks, block_size, self.dtype, self.device,
                                 with_drafter=self.mtp is not None, tp=self.tp)


def check_pools(rt: "Runtime", pools: CachePools) -> None:
    """One line when pools do not hold what rt's (sharded) model reads: pools built for another
    rank count than the model's (a KDA state holds only this rank's heads)."""
    want = {c.name: c.shape for c in family_of(rt.cfg).state_components(rt.cfg, rt.dtype, tp=rt.tp)}
    for name, pool in pools.pools.items():
        if name in want and pool.shape != want[name]:
            raise UserError(f"the {name} state pool has shape {list(pool.shape)} but the model, sharded over "
                            f"{rt.tp} rank(s), reads {list(want[name])}: its pools were not built for --tp {rt.tp}")


def make_engine(rt: "Runtime", pools: CachePools, config: EngineConfig) -> SpecEngine:
    """The engine over rt's target with its family's MTP head (none at gamma 0), as `config` says
    (resolved for rt first: `resolve`)."""
    config = resolve(rt, config)
    check_pools(rt, pools)
    proposer = None
    if config.drafts and rt.mtp is not None:
        draft_ids = None
        if config.draft_vocab is not None:
            path = Path(config.draft_vocab_file) if config.draft_vocab_file is not None else None
            draft_ids = load_draft_ids(rt.resolved.folder, config.draft_vocab, rt.cfg.vocab_size, rt.device, path=path)
        proposer = mtp_proposer(rt.cfg, rt.target, rt.mtp, pools, config, draft_ids)
    tokenizer = rt.resolved.folder / "tokenizer.json" if rt.resolved.folder is not None else None
    grammars = (Grammars(tokenizer, rt.cfg.vocab_size, rt.cfg.eos_token_id, config.constrain_after)
                if tokenizer is not None and tokenizer.is_file() else None)  # its tokenizer built at first use
    return SpecEngine(rt.cfg, rt.target, proposer, pools, config, rt.device, rt.comm, grammars)


def resolve(rt: "Runtime", config: EngineConfig) -> EngineConfig:
    """`config` with what depends on the loaded model made concrete (idempotent): max_seq_len (the
    model's limit when not given), compile (the family's default) and the forward mode (graph_mode,
    for "auto" and "off")."""
    limit = rt.cfg.max_position_embeddings
    compile = default_compile(rt.cfg) if config.compile is None else config.compile
    graphs = config.graphs
    if graphs in ("auto", "off"):
        graphs = graph_mode(rt, graphs == "auto", compile)
        if config.prefill_graphs and graphs != "cuda":
            raise UserError("--prefill-graphs replays the prefill from CUDA graphs: it needs --device cuda with CUDA "
                            "graphs on")
    return config.replace(max_seq_len=config.max_seq_len or limit, compile=compile, graphs=graphs)


def graph_mode(rt: "Runtime", cuda_graphs: bool, compile: str = "off") -> str:
    """The engine's forward mode: CUDA graphs on CUDA unless switched off, under --tp too (each rank
    captures the same forwards in the same order, its NCCL collectives inside: parallel.Comm);
    eager on the CPU (gloo collectives cannot be captured; static mode runs there only when asked,
    as the tests do) and for a model with fixed-size state slots whose forwards cannot read them
    through slot indices (Target.reads_slots; GLM-5-Next's can). With --compile (other than off)
    the static forwards run compiled: static mode where no graph is captured."""
    slots = any(c.kind == SLOT for c in family_of(rt.cfg).state_components(rt.cfg, rt.dtype))
    static_ok = not slots or rt.target.reads_slots
    if cuda_graphs and rt.device.type == "cuda" and static_ok:
        return "cuda"
    if compile != "off":
        if not static_ok:
            raise UserError(f"--compile {compile}: this model's decode forwards cannot run as static forwards")
        return "static"
    return "eager"


def freeze_startup_heap() -> None:
    """Move every object alive now (imported modules, the models) out of the cyclic collector's
    reach, as vLLM does after its start-up. Those ~300k objects are never garbage, but each full
    collection walked them all: ~100 ms per collection on this project's CPU, and one such pause
    inside a decode step (a 130 ms step against a 3 ms median at batch 64 on the H200) decided a
    whole adaptive run's comparison. Objects made later (engines, results) stay collectable. At
    exit they are handed back (nanobind, under Triton, reports objects the final collection
    did not free as leaks)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many models a process loads
    atexit.register(gc.unfreeze)


def before_loading(name: str, cfg, dtype: torch.dtype, dev: torch.device, with_mtp: bool, comm=None) -> None:
    """What every load does before it reads a weight of cfg: refuse one that will not fit
    (memory_check.check_memory: under --tp this rank's share, and on the CPU that of every rank on
    this host, as they share its memory, each rank checked before any loads, a barrier, so none
    counts another's weights against its own room), and say once that FP8 on the CPU is slow."""
    tp = comm.world if comm is not None else 1
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", tp)) if dev.type == "cpu" else 1
    check_memory(name, cfg, dtype, dev, with_mtp, tp, ranks)
    if comm is not None and dev.type == "cpu":
        comm.barrier()
    if dev.type == "cpu" and getattr(cfg, "fp8", False):
        note_fp8_on_cpu()


@functools.cache
def note_fp8_on_cpu() -> None:
    """Once a process: FP8 on the CPU is slow, and nothing else says so (with --fp8 on a busy 2-core
    machine, decode tokens/s fell from 17.5 to 8.0 for glm5-nano and from 15.5 to 10.9 for
    glm5next-nano; issue 32 saw 4x)."""
    print("note: FP8 weights on the CPU are dequantized before every matmul, 1.4-4x slower than unquantized "
          "ones; on CUDA they run in FP8 kernels", file=sys.stderr)


def load_runtime(spec: ModelSpec, with_mtp: bool = True, progress: bool = True, comm=None) -> Runtime:
    """The model `spec` names, loaded. comm (parallel.Comm): this rank's shard on its own GPU
    (cuda:local_rank) or the CPU. Random weights (spec.random_weights): the model's config with
    random tensors (checkpoint.RandomReader), built on the device (under --tp each rank draws its
    own slices); spec.fp8: those of the family's FP8 layout as GLM-5-FP8 stores them
    (checkpoint.resolve.as_fp8)."""
    dev = rank_device(spec.device, comm)
    dt = pick_dtype(spec.dtype, dev)
    resolved = resolve_model(spec.name, revision=spec.revision, need="all" if with_mtp else "target",
                             layers=spec.layers, progress=progress)
    share = spec.mtp_index_share
    if share is not None and not hasattr(resolved.config, "index_share_for_mtp_iteration"):
        raise UserError(f"--{'' if share else 'no-'}mtp-index-share: only GLM-5-Next models have "
                        f"index_share_for_mtp_iteration; this one is {resolved.config.model_type}")
    if spec.fp8:
        resolved = as_fp8(resolved)
    if comm is not None:
        from glm5mtp_cli.core.parallel import check_tp

        check_tp(resolved.config, comm.world)
    if resolved.has_weights or spec.random_weights:  # else load_models says there are none
        before_loading(spec.name, resolved.config, dt, dev, with_mtp, comm)
    target, mtp, extras = load_models(resolved, device=dev, dtype=dt, comm=comm, random_weights=spec.random_weights)
    if extras:
        # DeepSeek-style checkpoints carry the MTP layer's own head/embeddings; GLM-5's share the target's.
        raise UserError(f"{resolved.folder}: the MTP layer has its own {', '.join(sorted(extras))}; "
                        "glm5mtp drafts with the target's embeddings and head (GLM-5 layout)")
    # inference only: with parameters that require grad, the KDA commit's in-place write (outside
    # the forwards' no_grad) made the slot pool require grad, growing an autograd chain a commit
    # and recompiling each compiled forward once its guard saw the flag flip
    target.eval().requires_grad_(False)
    if mtp is not None:
        mtp.eval().requires_grad_(False)
        if share is not None:
            mtp.share_topk = share
    freeze_startup_heap()
    return Runtime(resolved, resolved.config, target, mtp, Tokenizer.maybe(resolved.folder), dev, dt, comm)
