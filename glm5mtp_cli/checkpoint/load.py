"""Build a model family's target and MTP layer on the meta device and fill them from a reader.

The loader never names a model: `models.family_of(cfg)` builds the modules, says where the MTP
layer lives in the checkpoint, which tensors stay fp32, and how to shard them over --tp ranks.
A module built on meta costs nothing until `materialize` allocates each tensor once, in its load
dtype, and `load_module` copies the checkpoint's values (or this rank's slices of them) in.
"""

from __future__ import annotations

from typing import Callable

import torch

from glm5mtp_cli.checkpoint.random import RandomReader
from glm5mtp_cli.checkpoint.read import CheckpointReader
from glm5mtp_cli.checkpoint.resolve import ResolvedModel
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.families import family_of
from glm5mtp_cli.models import fp8

# Tensors an MTP layer may carry in other checkpoints (DeepSeek style); GLM-5 shares the target's.
_MTP_EXTRAS = ("embed_tokens.weight", "shared_head.head.weight")


def materialize(module: torch.nn.Module, dtype: torch.dtype, device: str | torch.device = "cpu",
                keeps_fp32: Callable[[str], bool] | None = None) -> None:
    """Give every parameter and persistent buffer real storage of the load dtype on `device`.

    A module built on the meta device costs nothing until here; this allocates it exactly once.
    Tensors `keeps_fp32(name)` names (the family's rule: GLM-5's routers and indexer weighting)
    get fp32 whatever `dtype` is; FP8 weights and their scales (models/fp8.py) keep their dtypes. Values are left uninitialized:
    load_module writes every one of them. Tied parameters stay tied.
    """
    dev = torch.empty(0, device=device).device  # normalizes 'cuda' to 'cuda:0'
    replaced: dict[int, torch.Tensor] = {}
    for mod_name, mod in module.named_modules():
        pre = mod_name + "." if mod_name else ""
        for table, persistent_only in ((mod._parameters, False), (mod._buffers, True)):
            for n, t in list(table.items()):
                if t is None or (persistent_only and n in mod._non_persistent_buffers_set):
                    continue
                want = torch.float32 if keeps_fp32 is not None and keeps_fp32(pre + n) else dtype
                if t.dtype == fp8.FP8 or n.endswith(fp8.SCALE_SUFFIX):
                    want = t.dtype  # models/fp8.py's stored FP8 bytes and their fp32 scales
                if id(t) in replaced:
                    table[n] = replaced[id(t)]
                    continue
                if t.is_meta or t.dtype != want or t.device != dev:
                    new = torch.empty(t.shape, dtype=want, device=dev)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    replaced[id(t)] = new
                    table[n] = new


def load_module(module: torch.nn.Module, reader: CheckpointReader, prefix: str, dtype: torch.dtype,
                device: str | torch.device = "cpu", plan: dict | None = None,
                keeps_fp32: Callable[[str], bool] | None = None) -> list[str]:
    """Fill every state_dict entry of `module` (parameters and persistent buffers) from `reader`
    at `prefix + key`, checking shapes. Returns the keys loaded.

    The module may be on the meta device (it is materialized first). Loaded tensors are copied in
    place into what state_dict() returns, so modules whose state_dict presents per-checkpoint-name
    views of a fused tensor (stacked experts) load with no special case here.
    plan (tensor parallel): checkpoint name -> (dim, start, stop); those tensors are read as that
    slice only (the family's shard_target / shard_mtp give the module the sliced shapes).
    keeps_fp32: checkpoint names materialized in fp32 whatever `dtype` is (the family's rule).
    """
    materialize(module, dtype, device, None if keeps_fp32 is None else (lambda n: keeps_fp32(prefix + n)))
    loaded = []
    for key, dst in module.state_dict(keep_vars=True).items():
        name = prefix + key
        if not reader.has(name):
            raise UserError(f"tensor '{name}' is missing from the checkpoint at {reader.folder}")
        found = reader.shape(name)
        part = plan.get(name) if plan else None
        if part is not None:
            found = list(found)
            if len(found) <= part[0] or part[2] > found[part[0]]:
                raise UserError(f"tensor '{name}' in '{reader.folder / reader.file_of(name)}' has shape "
                                f"{found}: cannot take [{part[1]}:{part[2]}] of dim {part[0]}")
            found[part[0]] = part[2] - part[1]
        if tuple(found) != tuple(dst.shape):
            raise UserError(f"tensor '{name}' in '{reader.folder / reader.file_of(name)}' has shape "
                            f"{list(found)}, expected {list(dst.shape)}")
        if part is not None:
            t = reader.get_slice(name, *part, dst.dtype, dst.device)
        else:
            t = reader.get(name, dst.dtype, dst.device)
        with torch.no_grad():
            dst.copy_(t)
        loaded.append(key)
    return loaded


class _ParamsOnMeta:
    """Build modules with parameters on the meta device but buffers real.

    Parameters are the bulk (GLM-5: 1.5 TB) and get replaced by loaded tensors anyway; buffers
    include non-persistent ones (rope tables) that the checkpoint cannot restore, so they must be
    computed for real. `torch.empty` for a parameter reserves pages without touching them, and
    moving it to meta frees them, so construction costs no memory.
    """

    def __enter__(self):
        self._orig = torch.nn.Module.register_parameter
        orig = self._orig

        def register(mod, name, param):
            if param is not None and param.device.type != "meta":
                param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            orig(mod, name, param)

        torch.nn.Module.register_parameter = register
        return self

    def __exit__(self, *exc):
        torch.nn.Module.register_parameter = self._orig
        return False


def _check_no_meta(module: torch.nn.Module, what: str) -> None:
    left = [k for k, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{what}: tensors left unloaded on the meta device: {left[:5]}")


def build_loaded(build: Callable[[], torch.nn.Module], reader, prefix: str, dtype: torch.dtype,
                 device: str | torch.device = "cpu", keeps_fp32: Callable[[str], bool] | None = None,
                 shard: Callable[[torch.nn.Module], dict] | None = None, what: str = "module") -> torch.nn.Module:
    """`build()` with its parameters on meta, sharded by `shard` (returning the slicing plan) when
    given, its FP8-stored projections and expert stacks swapped for models/fp8.py's modules, then
    filled from `reader` at `prefix + key`, projections of one input joined (models/fp8.py): the one
    way every module gets its weights (a checkpoint's, or checkpoint.random's through a RandomReader)."""
    with _ParamsOnMeta():
        module = build()
    plan = shard(module) if shard is not None else None
    fp8.convert(module, reader, prefix, plan, reader.block)  # what the checkpoint stores FP8 stays FP8
    fp8.join_inputs(module, device)  # FP8 projections of one input: one matrix, one GEMM
    load_module(module, reader, prefix, dtype, device, plan, keeps_fp32)
    module.to(device)  # the non-persistent buffers; parameters are already there
    fp8.join_loaded(module)  # the same for projections loaded in the model dtype
    _check_no_meta(module, what)
    return module


def load_models(resolved: ResolvedModel, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                comm=None, stats: dict | None = None, random_weights: bool = False):
    """Build and load the target and the MTP layer. Returns (target, mtp, extras).

    target is None when resolved with need='mtp'; mtp is None with need='target'. The MTP layer is
    read from `model.layers.{N}` with N the checkpoint's own depth, even when --layers truncated the
    target. extras: the MTP layer's own `embed_tokens`/`shared_head.head` when the checkpoint has
    them (DeepSeek style; GLM-5 has none and shares the target's).
    comm (parallel.Comm, world > 1): build this rank's shard only (the family's sharding rules)
    and read only its slices.
    stats: when given, gets 'bytes_read' (bytes copied out of the shards).
    random_weights: random tensors of the config's shapes instead of the checkpoint's
    (checkpoint.random.RandomReader).
    """
    if not resolved.has_weights and not random_weights:
        raise UserError(f"model '{resolved.spec}' has no weights (config only); "
                        f"make some with `glm5mtp init-random {resolved.spec} DIR`")
    cfg = resolved.config
    source = resolved.source_config or cfg
    family = family_of(cfg)
    if random_weights:
        reader = RandomReader(source)
    else:
        reader = CheckpointReader(resolved.folder, resolved.weight_map, block=getattr(cfg, "fp8_block", (128, 128)))
    mtp_prefix = family.mtp_prefix(source)  # the checkpoint's own depth, whatever --layers kept
    wants_target = resolved.need in ("all", "target")
    wants_mtp = resolved.need in ("all", "mtp")
    target = mtp = None
    sharded = comm is not None and comm.world > 1
    try:
        if wants_target:
            target = build_loaded(lambda: family.build_target(cfg), reader, "", dtype, device, family.keeps_fp32,
                                  (lambda m: family.shard_target(m, comm)) if sharded else None, "target")
        if wants_mtp:
            mtp = build_loaded(lambda: family.build_mtp(cfg), reader, mtp_prefix, dtype, device, family.keeps_fp32,
                               (lambda m: family.shard_mtp(m, comm, mtp_prefix)) if sharded else None, "MTP layer")
        extras = {k: reader.get(mtp_prefix + k, dtype, device) for k in _MTP_EXTRAS if reader.has(mtp_prefix + k)}
        if stats is not None:
            stats["bytes_read"] = reader.bytes_read
    finally:
        reader.close()
    return target, mtp, extras
