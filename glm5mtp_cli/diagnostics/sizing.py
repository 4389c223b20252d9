"""The byte numbers `info`, `profile` and `bench` print and the load's memory check compares, asked of
the model family: checkpoint and in-memory weight bytes (whole, per --tp rank), per-sequence state
bytes, the decode steps' reads (their memory floors), verify scratch, CUDA-graph buffers, what a
loaded model holds before its first request, the cache layouts `info` compares (the byte formatter
is glm5mtp_cli/units.py, free of torch for the commands).

Per-sequence state comes from the family's `state_components(cfg, dtype, tp=...)`: each component's
StateComponent.unit_bytes (a row of all its layers, or a whole recurrent slot, per rank) and
bytes_for(tokens, block_size), so a family with fixed-size recurrent slots is counted by the same
code as GLM-5's paged rows. Weights read the family's checkpoint layout, its FP8 rules and its
split_over_ranks (models/bytes.py: the primitives every family shares); what differs by family (the
decode steps' reads, a verify's scratch, what a verify graph keeps for a commit, the tp notes) is
the family's `sizing` module (models/glm5/sizing.py, models/glm5_next/sizing.py), never a branch on
its name here. Activation formulas (scratch, graphs) are those of the PyTorch path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models.bytes import moe_gather_bytes, rank_share, tensor_bytes
from glm5mtp_cli.core.dtypes import dtype_bytes
from glm5mtp_cli.core.family import ROWS, SLOT

if TYPE_CHECKING:  # no torch for the arithmetic: `info` sizes a model from its config alone
    import torch

GIB = 2**30
BF16 = 2


# ---- weights ------------------------------------------------------------------------------------

def checkpoint_tensor_bytes(cfg, name: str, shape: tuple[int, ...]) -> int:
    """Bytes a checkpoint with cfg's dtype and quantization stores for one tensor."""
    fp8 = getattr(cfg, "fp8", False)  # only families with FP8 checkpoints have the field
    return tensor_bytes(cfg, name, shape, dtype_bytes(cfg.torch_dtype), cfg.fp8_block if fp8 else None)


def weight_bytes_per_rank(cfg, tp: int, fmt: str, with_mtp: bool = True) -> dict[str, int]:
    """Bytes of weights on one rank for a checkpoint format: 'bf16' (2 bytes each) or 'fp8' (the
    FP8 checkpoint's quantized matrices at 1 byte plus one fp32 scale per 128x128 block, the rest
    bf16); fp32 for what the model keeps in fp32 in both. A split tensor is 1/tp of its bytes per
    rank (whole experts, head groups, vocabulary rows). Returns {'sharded', 'replicated', 'total'}."""
    split = family_of(cfg).split_over_ranks
    out = {"sharded": 0, "replicated": 0}
    for name, shape in model_tensors(cfg, with_mtp):
        b = tensor_bytes(cfg, name, shape, BF16, (128, 128) if fmt == "fp8" else None, held=True)
        if split(name):
            out["sharded"] += -(-b // tp)
        else:
            out["replicated"] += b
    out["total"] = out["sharded"] + out["replicated"]
    return out


def model_tensors(cfg, with_mtp: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """The family's checkpoint tensors, without the MTP layer's unless with_mtp."""
    family = family_of(cfg)
    mtp = family.mtp_prefix(cfg)
    return [(n, s) for n, s in family.tensor_shapes(cfg) if with_mtp or not n.startswith(mtp)]


def predicted_weight_bytes(cfg, dtype: torch.dtype, with_mtp: bool = True, tp: int = 1) -> int:
    """Bytes of the weights as loaded on one device (one of `tp` ranks: its share of the split
    tensors): the runtime dtype's size each, but fp32 for the tensors the model keeps in fp32
    (routers, indexer weighting) and, for an FP8 checkpoint, its quantized matrices as stored (1 byte
    each plus one fp32 scale per block: models/fp8.py keeps them)."""
    return _held_bytes(cfg, model_tensors(cfg, with_mtp), dtype, tp)


def _held_bytes(cfg, tensors: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, tp: int) -> int:
    block = cfg.fp8_block if getattr(cfg, "fp8", False) else None
    return sum(rank_share(cfg, name, tensor_bytes(cfg, name, shape, dtype_bytes(dtype), block, held=True), tp)
               for name, shape in tensors)


# ---- per-sequence state -------------------------------------------------------------------------

def bytes_per_token(cfg, dtype: torch.dtype, with_drafter: bool = True) -> dict[str, int]:
    """State bytes per token by component (REFERENCE section 5): one row of each paged component
    over all its layers; fixed-size slots grow with no token (0). Drafter components are 0
    without a drafter."""
    return {c.name: c.unit_bytes if c.kind == ROWS and (c.owner == "target" or with_drafter) else 0
            for c in family_of(cfg).state_components(cfg, dtype, with_drafter=True)}


def state_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, with_drafter: bool = True,
                tp: int = 1) -> dict[str, int]:
    """Bytes one sequence holds per component on one of `tp` ranks when it reserves `tokens` rows
    (whole blocks of paged rows, plus each slot once); drafter components are 0 without a drafter."""
    return {c.name: c.bytes_for(tokens, block_size) if c.owner == "target" or with_drafter else 0
            for c in family_of(cfg).state_components(cfg, dtype, with_drafter=True, tp=tp)}


def draft_step_bytes(cfg, elem_bytes: int, context: int, draft_vocab: int | None = None, tp: int = 1) -> dict:
    """Bytes one chained draft step reads at batch 1 on one of `tp` ranks (the floor's numerator),
    by component: the family's formula (models/<family>/sizing.py)."""
    return family_of(cfg).sizing.draft_step_bytes(cfg, elem_bytes, context, draft_vocab, tp)


def target_step_bytes(cfg, elem_bytes: int, context: int, tp: int = 1) -> dict:
    """Bytes one batch-1 decode step of the (truncated) target reads on one of `tp` ranks, by
    component: the family's formula."""
    return family_of(cfg).sizing.target_step_bytes(cfg, elem_bytes, context, tp)


ROUTED = "routed experts"  # the component name both families' component_of give routed expert tensors


def routed_expert_bytes(cfg, elem_bytes: int, tp: int = 1) -> dict[str, int]:
    """The routed experts' share of draft_step_bytes ('mtp') and target_step_bytes ('target'), as their
    formulas count them: top-k of E experts a token, this rank's share (`plan` scales it to the
    experts a batch of tokens touches)."""
    family = family_of(cfg)
    mtp = family.mtp_prefix(cfg)
    block = cfg.fp8_block if getattr(cfg, "fp8", False) else None
    out = {"mtp": 0, "target": 0}
    for name, shape in family.tensor_shapes(cfg):
        if family.component_of(cfg, name) != ROUTED:
            continue
        b = tensor_bytes(cfg, name, shape, elem_bytes, block, held=True)
        out["mtp" if name.startswith(mtp) else "target"] += rank_share(
            cfg, name, b * cfg.num_experts_per_tok // cfg.n_routed_experts, tp)
    return out


PER_ROW = ("cache", "kda_state", "embed_row")  # the step components read again per row


def touched_experts_factor(tokens: int, experts: int, top_k: int) -> float:
    """Distinct experts N tokens touch, relative to one token's top-k: (E/k)(1 - (1 - k/E)^N)."""
    return experts / top_k * (1.0 - (1.0 - top_k / experts) ** tokens)


def reread_experts_factor(tokens: int, experts: int, top_k: int) -> float:
    """Expert weights the few-pair MoE kernels (kernels/moe.py) stream beyond the distinct experts N
    tokens touch, relative to one token's top-k: their GEMV programs stream the expert once per
    (token, expert) pair, N - (E/k)(1 - (1 - k/E)^N) more than once per distinct expert (a verify
    of 32 GLM-5 tokens: 256 pairs over ~163 experts). 0 where the grouped GEMM runs instead
    (kernels/moe_grouped.pays: an expert's weight tile is shared by a block's rows, the GEMM's own
    tiling). Whether the repeats come from HBM or L2 is what the calibration's `reread_fraction`
    prices."""
    from kernels.moe_grouped import pays

    if pays(tokens * top_k, experts):
        return 0.0
    return max(0.0, tokens - touched_experts_factor(tokens, experts, top_k))


def batch_step_bytes(step_bytes: dict, routed: int, tokens: int, state_reads: int, experts: int, top_k: int) -> float:
    """A forward of `tokens` rows in all from a batch-1 step's reads (draft_step_bytes or
    target_step_bytes, whose routed experts are `routed`): weights once, the routed experts as many
    as N tokens routed top-k of E uniformly touch (E (1 - (1 - k/E)^N); k at N = 1), the per-row
    state (PER_ROW) `state_reads` times."""
    per_read = sum(step_bytes.get(k, 0) for k in PER_ROW)
    shared = step_bytes["total"] - per_read - routed
    return shared + routed * touched_experts_factor(tokens, experts, top_k) + state_reads * per_read


def scratch_bytes(cfg, dtype: torch.dtype, context: int, gamma: int) -> int:
    """Transient bytes of one verify forward of gamma+1 rows at `context` cached rows (the family's
    PyTorch path, its formula)."""
    return family_of(cfg).sizing.scratch_bytes(cfg, dtype, context, gamma)


def graph_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, gamma: int, max_seq_len: int) -> int:
    """What a one-slot greedy engine's CUDA graphs (profile's) keep allocated between replays
    (graphs.EngineGraphs, one bucket, one gamma) for a sequence of `tokens` reserved rows: the static
    inputs (ids, lengths, row slots, drafter hiddens), the block tables of each row component
    (table_blocks wide, 8 bytes a block; the slot's row and the all-scratch row), the slot indices of
    each slot component (the same two entries) and the outputs the graphs own (the verify's logits,
    hiddens and verdict rows, GLM-5-Next's KDA commit records; the fused chain's drafts; a sampling
    engine has no verdict rows, (gamma + 2) x 8 bytes less). Their intermediates live in the graphs'
    private pool, the same peak as `scratch`."""
    from glm5mtp_cli.engine.graphs import table_blocks  # the graphs' module imports torch

    d, t = dtype_bytes(dtype), gamma + 1
    tables = 2 * 8 * table_blocks(tokens, block_size, max_seq_len)
    comps = family_of(cfg).state_components(cfg, dtype)

    def indices(owner: str) -> int:
        return sum(tables if c.kind == ROWS else 2 * 8 for c in comps if c.owner == owner)

    verify = 8 + t * 8 + 8 + indices("target") + t * cfg.vocab_size * d + t * cfg.hidden_size * d
    verify += family_of(cfg).sizing.verify_record_bytes(cfg, dtype, t)
    verify += (t + 1) * 8  # the verdict: accepted count, next token, the drafts (graphs.verify_forward)
    if gamma == 0:
        return verify
    draft = t * 8 + 8 + 8 + indices("drafter") + t * cfg.hidden_size * d + gamma * 8
    return verify + draft


def predicted_bytes(cfg, dtype: torch.dtype, tokens: int, block_size: int, gamma: int,
                    scratch_context: int, max_seq_len: int, tp: int = 1) -> dict[str, int]:
    """One sequence's predicted bytes by component at `tokens` reserved rows (on one of `tp` ranks),
    plus the verify scratch at `scratch_context` cached rows and the CUDA graphs' buffers (under
    --max-seq-len max_seq_len), and their total."""
    out = state_bytes(cfg, dtype, tokens, block_size, with_drafter=gamma > 0, tp=tp)
    out["scratch"] = scratch_bytes(cfg, dtype, scratch_context, gamma)
    out["cuda_graphs"] = graph_bytes(cfg, dtype, tokens, block_size, gamma, max_seq_len)
    out["total"] = sum(out.values())
    return out


def growth_bytes(cfg, dtype: torch.dtype, gamma: int, with_drafter: bool, tokens: int = 1000) -> int:
    """Bytes one sequence grows by over `tokens` more tokens: its rows and the verify scratch."""
    return (sum(bytes_per_token(cfg, dtype, with_drafter).values()) * tokens
            + scratch_bytes(cfg, dtype, tokens, gamma) - scratch_bytes(cfg, dtype, 0, gamma))


# ---- what a loaded model holds (engine/memory_check.py checks it before loading) ----------------------

def resident_bytes(cfg, dtype: torch.dtype, device_type: str, with_mtp: bool, tp: int = 1,
                   block_size: int = 16) -> dict[str, int]:
    """Bytes one of `tp` ranks holds once cfg is loaded and its engine runs, as far as the config
    alone says (a command's prompts and batch come later): the weights as held
    (predicted_weight_bytes), the pools of a first sequence (one block of each row component and
    one slot each, twice: Runtime.make_pools adds a scratch block, and a slot pool has a slot per
    block; block_size: make_pools's) and one forward's scratch (a verify of the default gamma at
    that context; on the CPU also the MoE's gathered experts, moe_gather_bytes). Returns
    {'weights', 'state', 'scratch', 'total'}."""
    tensors = model_tensors(cfg, with_mtp)
    blocks = 2
    comps = family_of(cfg).state_components(cfg, dtype, with_drafter=with_mtp, tp=tp)
    out = {"weights": _held_bytes(cfg, tensors, dtype, tp),
           "state": sum(c.unit_bytes * (blocks if c.kind == SLOT else blocks * block_size) for c in comps),
           "scratch": scratch_bytes(cfg, dtype, block_size, EngineConfig.gamma if with_mtp else 0)}
    if device_type == "cpu":  # on CUDA the MoE kernels read the stacks in place
        out["scratch"] += moe_gather_bytes(cfg, tensors, dtype_bytes(dtype))
    out["total"] = sum(out.values())
    return out


# ---- cache layouts compared by `info` (bf16 vs fp8, per layer) --------------------------------------

def cache_bytes_per_token(cfg) -> dict[str, int]:
    """Bytes per token per layer for each cache layout (REFERENCE section 5)."""
    block = 128  # one fp32 scale per 128 values in the fp8 layouts
    return {
        "mla_bf16": cfg.kv_cache_width * BF16,
        # vLLM fp8_ds_mla: latent in fp8 with fp32 scales per 128, rope part kept bf16
        "mla_fp8": cfg.kv_lora_rank + 4 * (-(-cfg.kv_lora_rank // block)) + cfg.qk_rope_head_dim * BF16,
        "indexer_bf16": cfg.index_head_dim * BF16,
        "indexer_fp8": cfg.index_head_dim + 4 * (-(-cfg.index_head_dim // block)),
    }


def cache_layers(cfg) -> dict[str, int]:
    """Layers holding each cache: every layer has MLA; only 'full' indexer layers keep index keys."""
    mtp = 1 if cfg.num_nextn_predict_layers else 0
    return {"mla_target": cfg.num_hidden_layers, "indexer_target": cfg.indexer_layers, "mla_mtp": mtp,
            "indexer_mtp": mtp}


# ---- tensor parallelism: weights, cache and concurrency per GPU --------------------------------------

def tp_table(cfg, gpu_mem: int, doc: dict, tp: int, with_mtp: bool, dtype: torch.dtype) -> dict:
    """Weights, bytes per sequence and concurrent sequences per GPU for tp in {1, 2, 4, 8, --tp}
    that the family's sharding rules divide, for the bf16 and the FP8 checkpoint (weights as served:
    FP8 stays 1 byte + block scales). A sequence's state on one rank is the family's
    state_components at that tp (pools of the same sizes as the engine's); its verify scratch and
    graph buffers are the tp 1 values (an upper bound: attention heads split too).
    `doc` is run_profile's document (its rows alternate ceiling, budget)."""
    family = family_of(cfg)
    has_fp8 = any(family.is_fp8_quantized(cfg, name, shape) for name, shape in family.tensor_shapes(cfg))
    formats = ("bf16", "fp8") if has_fp8 else ("bf16",)  # a family without an FP8 layout has no fp8 rows
    rows = []
    from glm5mtp_cli.core.parallel import check_tp

    for n in sorted({1, 2, 4, 8, tp}):
        try:
            check_tp(cfg, n)
        except UserError:
            continue
        for fmt in formats:
            w = weight_bytes_per_rank(cfg, n, fmt, with_mtp)
            for r_ceil, r_bud in zip(doc["rows"][0::2], doc["rows"][1::2]):
                state, transient, per = {}, {}, {}
                for policy, r in (("ceiling", r_ceil), ("budget", r_bud)):
                    st = state_bytes(cfg, dtype, r["reserved_tokens"], doc["block_size"], with_mtp, tp=n)
                    state[policy] = sum(st.values())
                    transient[policy] = r["per_sequence_bytes"]["scratch"] + r["per_sequence_bytes"]["cuda_graphs"]
                    per[policy] = state[policy] + transient[policy]
                free = gpu_mem - w["total"]
                rows.append({"tp": n, "format": fmt, "weights_per_gpu_bytes": w["total"],
                             "sharded_per_gpu_bytes": w["sharded"], "replicated_per_gpu_bytes": w["replicated"],
                             "max_seq_len": r_ceil["max_seq_len"], "state_per_sequence_bytes": state,
                             "scratch_graphs_per_sequence_bytes": transient, "per_sequence_bytes": per,
                             "max_concurrent_sequences": {k: max(0, free // v) for k, v in per.items()}})
    return {"rows": rows, "notes": family.sizing.TP_NOTES}


