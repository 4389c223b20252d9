"""Find a model (profile | local folder | Hub repo id), fetch only the shards a run needs, read
tensors lazily from safetensors, dequantize FP8 blocks, and load them into modules.

Memory rule: never the whole checkpoint at once. A reader keeps at most a couple of shards open
(memory-mapped by safetensors) and copies out one tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
import torch

from glm5mtp_cli.models.glm5 import layout
from glm5mtp_cli.models.glm5.config import ModelConfig, list_profiles, profile_path
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.models.glm5.layout import keeps_fp32

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Tensors an MTP layer may carry in other checkpoints (DeepSeek style); GLM-5 shares the target's.
_MTP_EXTRAS = ("embed_tokens.weight", "shared_head.head.weight")


@dataclass
class ResolvedModel:
    spec: str
    kind: str                      # 'profile' | 'local' | 'hub'
    folder: Path
    config: ModelConfig            # truncated to --layers when given
    weight_map: dict[str, str]     # needed tensor name -> shard file (relative to folder)
    has_weights: bool
    mtp_index: int                 # the checkpoint's own num_hidden_layers: where the MTP layer lives
    need: str = "all"              # 'all' | 'target' | 'mtp': what weight_map was filtered for
    source_config: ModelConfig | None = field(repr=False, default=None)  # the untruncated config

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


# ---- resolving ----------------------------------------------------------------------------------

def _env_truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> str | None:
    """The Hub cache folder from the environment at call time.

    huggingface_hub reads HF_HOME/HF_HUB_CACHE once at import; reading them here makes a changed
    environment (tests, or a wrapper that sets them late) take effect.
    """
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def hub_offline() -> bool:
    return _env_truthy("HF_HUB_OFFLINE")


def needed_tensor(name: str, need: str, target_layers: int, mtp_index: int) -> bool:
    """Whether a run with `need` reads tensor `name` (top-level tensors are always needed)."""
    m = _LAYER.match(name)
    if m is None:
        return True
    layer = int(m.group(1))
    if layer == mtp_index:
        return need in ("all", "mtp")
    return need in ("all", "target") and layer < target_layers


def _check_need(need: str) -> None:
    if need not in ("all", "target", "mtp"):
        raise ValueError(f"need must be 'all', 'target' or 'mtp', got {need!r}")


def resolve_model(spec: str, revision: str | None = None, token: str | None = None, need: str = "all",
                  layers: int | None = None, progress: bool = True) -> ResolvedModel:
    """Locate `spec` and make the tensors a run `need`s available locally (downloading from the Hub
    only the shards that hold them)."""
    _check_need(need)
    folder, kind = _locate(spec)
    if kind == "hub":
        return _resolve_hub(spec, revision, token, need, layers, progress)
    cfg = ModelConfig.from_json_file(folder / "config.json")
    full_map = local_weight_map(folder)
    return _finish(spec, kind, folder, cfg, full_map, need, layers, check_files=True)


def resolve_config(spec: str, revision: str | None = None, token: str | None = None) -> tuple[ModelConfig, str]:
    """Only the config of `spec` (for `info`): no weights are read or fetched. Returns (config, kind)."""
    folder, kind = _locate(spec)
    if kind == "hub":
        path = _hub_file(spec, "config.json", revision, token, what="config.json")
        return ModelConfig.from_json_file(path), kind
    return ModelConfig.from_json_file(folder / "config.json"), kind


def _locate(spec: str) -> tuple[Path | None, str]:
    if not spec:
        raise UserError("no model given")
    p = profile_path(spec)
    if p is not None:
        return p, "profile"
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"model folder '{local}' has no config.json")
        return local, "local"
    if local.exists():
        raise UserError(f"model '{spec}' is a file; give the folder holding config.json")
    if _REPO_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return None, "hub"
    raise UserError(f"model '{spec}' not found: not a profile ({', '.join(list_profiles())}), "
                    f"not a local folder, and not a Hub repo id (org/name)")


def local_weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file of a local folder: from the index, a single model.safetensors, or {}."""
    index = folder / INDEX_FILE
    if index.is_file():
        return _read_index(index)
    single = folder / SINGLE_FILE
    if single.is_file():
        return {name: SINGLE_FILE for name in _keys_of(single)}
    return {}


def _read_index(path: Path) -> dict[str, str]:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable shard index ({e})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise UserError(f"{path}: shard index has no valid 'weight_map'")
    return dict(wm)


def _keys_of(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # SafetensorError or OSError: a corrupt or unreadable file
        raise UserError(f"{path}: not a readable safetensors file ({_short(e)})") from None


def _finish(spec, kind, folder, cfg, full_map, need, layers, check_files) -> ResolvedModel:
    mtp_index = cfg.num_hidden_layers
    truncated = cfg.with_layers(layers) if layers is not None else cfg
    wm = {n: f for n, f in full_map.items() if needed_tensor(n, need, truncated.num_hidden_layers, mtp_index)}
    if check_files:
        for f in sorted(set(wm.values())):
            if not (folder / f).is_file():
                raise UserError(f"shard file '{f}' listed in {folder / INDEX_FILE} is missing")
    return ResolvedModel(spec=spec, kind=kind, folder=folder, config=truncated, weight_map=wm,
                         has_weights=bool(full_map), mtp_index=mtp_index, need=need, source_config=cfg)


# ---- the Hub ------------------------------------------------------------------------------------

def _hub_status(repo: str, filename: str, offline: bool):
    """A spinner on stderr while the Hub client tries (it retries for ~25 s without network)."""
    import contextlib

    from rich.console import Console

    if offline:
        return contextlib.nullcontext()
    return Console(stderr=True).status(f"asking the Hugging Face Hub for {repo} ({filename}); without network "
                                       "it retries for ~25 s: set HF_HUB_OFFLINE=1 to use only the local cache")


def _hub_file(repo: str, filename: str, revision: str | None, token: str | None, what: str) -> Path:
    """One file of a Hub repo through huggingface_hub's cache (offline: the cache only)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub import errors as hub_errors

    from huggingface_hub.utils import logging as hub_logging

    offline = hub_offline()
    # The client logs each retry of an unreachable Hub; the user gets one line from us instead.
    hub_logging.set_verbosity_error()
    try:
        with _hub_status(repo, filename, offline):
            return Path(hf_hub_download(repo, filename, revision=revision, token=token,
                                        cache_dir=hub_cache_dir(), local_files_only=offline))
    except hub_errors.GatedRepoError:
        raise UserError(f"model '{repo}' is gated: accept its terms on the Hub and pass --token") from None
    except hub_errors.RepositoryNotFoundError:
        raise UserError(f"model '{repo}' not found on the Hugging Face Hub (private? pass --token)") from None
    except hub_errors.RevisionNotFoundError:
        raise UserError(f"model '{repo}': revision '{revision}' not found on the Hub") from None
    except hub_errors.EntryNotFoundError:  # includes LocalEntryNotFoundError
        if what == "config.json":
            where = ("in the Hugging Face cache (offline)" if offline else
                     "reachable on the Hugging Face Hub or in its cache (without network, set HF_HUB_OFFLINE=1 "
                     "to skip the Hub's retries)")
            raise UserError(f"model '{repo}' not found: not a profile, not a local folder, and not {where}") from None
        raise
    except hub_errors.HfHubHTTPError as e:
        raise UserError(f"model '{repo}': Hub error fetching {filename}: {_short(e)}") from None
    except hub_errors.HFValidationError as e:
        raise UserError(f"model '{repo}' is not a valid Hub repo id ({_short(e)})") from None
    except OSError as e:
        raise UserError(f"model '{repo}': cannot fetch {filename}: {_short(e)}") from None


def _resolve_hub(repo, revision, token, need, layers, progress) -> ResolvedModel:
    from huggingface_hub import errors as hub_errors

    cfg_path = _hub_file(repo, "config.json", revision, token, what="config.json")
    folder = cfg_path.parent  # the snapshot folder; shards land beside config.json
    cfg = ModelConfig.from_json_file(cfg_path)
    try:
        full_map = _read_index(_hub_file(repo, INDEX_FILE, revision, token, what=INDEX_FILE))
    except hub_errors.EntryNotFoundError:
        try:
            full_map = {n: SINGLE_FILE for n in _keys_of(_hub_file(repo, SINGLE_FILE, revision, token, what=SINGLE_FILE))}
        except hub_errors.EntryNotFoundError:
            if hub_offline():
                raise UserError(f"model '{repo}': no weights in the Hugging Face cache (offline); "
                                f"unset HF_HUB_OFFLINE to download them") from None
            full_map = {}  # a config-only repo
    resolved = _finish(repo, "hub", folder, cfg, full_map, need, layers, check_files=False)
    _fetch_shards(repo, resolved.files, revision, token, progress)
    return resolved


def _fetch_shards(repo: str, files: list[str], revision, token, progress: bool) -> None:
    from huggingface_hub import errors as hub_errors
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    def fetch(f: str) -> None:
        try:
            _hub_file(repo, f, revision, token, what=f)
        except hub_errors.EntryNotFoundError:
            where = "in the Hugging Face cache (offline)" if hub_offline() else "on the Hub"
            raise UserError(f"model '{repo}': shard '{f}' named in {INDEX_FILE} is not {where}") from None

    if not progress or not files:
        for f in files:
            fetch(f)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()  # one Rich bar over shards instead of one tqdm bar per file
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True) as bar:
            task = bar.add_task(f"shards of {repo}", total=len(files))
            for f in files:
                fetch(f)
                bar.advance(task)
    finally:
        if not was_disabled:
            enable_progress_bars()


# ---- reading ------------------------------------------------------------------------------------

def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Reference FP8 block dequantization: fp32 `w * scale_inv` with one scale per block.

    Edge blocks may be partial: the scale grid is ceil(rows/b0) x ceil(cols/b1) and each scale
    covers whatever part of its block lies inside the matrix.
    """
    rows, cols = w.shape
    b0, b1 = block
    grid = (-(-rows // b0), -(-cols // b1))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not match {grid} for a {rows}x{cols} weight")
    s = scale_inv.float().repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return w.float() * s


class CheckpointReader:
    """Lazy tensor access over a folder of safetensors shards.

    Keeps at most `max_open` shards open (least recently used closed first). `files_opened`
    records every shard ever opened, so tests can prove a run touched only the shards it needed.
    """

    def __init__(self, folder: str | os.PathLike, weight_map: dict[str, str], max_open: int = 2,
                 block: tuple[int, int] = (128, 128)):
        self.folder = Path(folder)
        self.weight_map = dict(weight_map)
        self.max_open = max_open
        self.block = block
        self.files_opened: set[str] = set()
        self.bytes_read = 0  # bytes copied out of the shards (tests: a rank reads only its slices)
        self._open: OrderedDict[str, object] = OrderedDict()
        self._keys: dict[str, set[str]] = {}  # names each opened shard holds (small: names only)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> str:
        if name not in self.weight_map:
            raise UserError(f"tensor '{name}' is not in the checkpoint at {self.folder} (no shard lists it)")
        return self.weight_map[name]

    def _handle(self, file: str):
        from safetensors import safe_open

        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        path = self.folder / file
        if not path.is_file():
            raise UserError(f"shard file '{path}' is missing")
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # SafetensorError (bad header) or OSError
            raise UserError(f"shard file '{path}' is corrupt or unreadable ({_short(e)})") from None
        self.files_opened.add(file)
        self._open[file] = handle
        self._keys[file] = set(handle.keys())
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return handle

    def _holding(self, name: str):
        """The open shard that holds `name`, after checking the shard really has it."""
        file = self.file_of(name)
        handle = self._handle(file)
        if name not in self._keys[file]:
            raise UserError(f"tensor '{name}' is listed under '{file}' but that shard at {self.folder} lacks it")
        return file, handle

    def shape(self, name: str) -> tuple[int, ...]:
        file, handle = self._holding(name)
        try:
            return tuple(handle.get_slice(name).get_shape())
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({_short(e)})") from None

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (fp8 stays fp8)."""
        file, handle = self._holding(name)
        try:
            t = handle.get_tensor(name)
        except Exception as e:  # a truncated data region
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({_short(e)})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def raw_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) [start, stop) of a stored tensor, read lazily: only the
        slice is copied out of the memory-mapped shard."""
        file, handle = self._holding(name)
        try:
            sl = handle.get_slice(name)
            t = sl[start:stop] if dim == 0 else sl[:, start:stop]
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({_short(e)})") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
        """`get` of a slice along dim 0 or 1. FP8 weights read the whole scale blocks the slice
        touches, dequantize them and trim, so any boundary works."""
        file, handle = self._holding(name)
        try:
            stored = handle.get_slice(name).get_dtype()
        except Exception as e:
            raise UserError(f"tensor '{name}' unreadable in '{self.folder / file}' ({_short(e)})") from None
        if stored.upper() in ("F8_E4M3", "FLOAT8_E4M3FN"):
            scale_name = name + "_scale_inv"
            if not self.has(scale_name):
                raise UserError(f"FP8 tensor '{name}' has no '{scale_name}' in the checkpoint at {self.folder}")
            b = self.block[dim]
            full = self.shape(name)[dim]
            s0, s1 = start // b, -(-stop // b)
            w = self.raw_slice(name, dim, s0 * b, min(s1 * b, full))
            scale = self.raw_slice(scale_name, dim, s0, s1)
            try:
                t = dequant_fp8_block(w, scale, self.block)
            except ValueError as e:
                raise UserError(f"FP8 tensor '{name}' in '{file}': {e}") from None
            t = t.narrow(dim, start - s0 * b, stop - start)
        else:
            t = self.raw_slice(name, dim, start, stop)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if torch.device(device) != t.device else t

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        t = self.raw(name)
        if t.dtype == torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if not self.has(scale_name):
                raise UserError(f"FP8 tensor '{name}' has no '{scale_name}' in the checkpoint at {self.folder}")
            try:
                t = dequant_fp8_block(t, self.raw(scale_name), self.block)
            except ValueError as e:
                raise UserError(f"FP8 tensor '{name}' in '{self.file_of(name)}': {e}") from None
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if torch.device(device) != t.device else t

    def close(self) -> None:
        self._open.clear()


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


# ---- loading into modules -------------------------------------------------------------------------

def materialize(module: torch.nn.Module, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
    """Give every parameter and persistent buffer real storage of the load dtype on `device`.

    A module built on the meta device costs nothing until here; this allocates it exactly once.
    Router/indexer-weighting tensors get fp32 whatever `dtype` is. Values are left uninitialized:
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
                want = torch.float32 if keeps_fp32(pre + n) else dtype
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
                device: str | torch.device = "cpu", plan: dict | None = None) -> list[str]:
    """Fill every state_dict entry of `module` (parameters and persistent buffers) from `reader`
    at `prefix + key`, checking shapes. Returns the keys loaded.

    The module may be on the meta device (it is materialized first). Loaded tensors are copied in
    place into what state_dict() returns, so modules whose state_dict presents per-checkpoint-name
    views of a fused tensor (stacked experts) load with no special case here.
    plan (tensor parallel): checkpoint name -> (dim, start, stop); those tensors are read as that
    slice only (parallel.shard_target / shard_mtp give the module the sliced shapes).
    """
    materialize(module, dtype, device)
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


class RandomReader:
    """Stands in for a CheckpointReader: every tensor of the config's layout, random, built on the
    device it is asked for, so GLM-5's real dimensions run without 1.5 TB on disk. Values are
    seeded by tensor name and drawn whole before any slicing, so the ranks of --tp hold exactly
    the slices of what one device would hold. Matrices ~ N(0, 0.02); norms 1; biases 0."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.folder = Path(f"<random weights: {cfg.source}>")
        self.seed = seed
        self.bytes_read = 0
        self.shapes = dict(layout.all_tensor_shapes(cfg))

    def has(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> list[int]:
        return list(self.shapes[name])

    def file_of(self, name: str) -> str:
        return "random"

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            t = torch.zeros(shape, device=device) if name.endswith("bias") else torch.ones(shape, device=device)
        else:
            gen = torch.Generator(device=device).manual_seed(self.seed ^ zlib.crc32(name.encode()))
            t = torch.randn(shape, generator=gen, device=device).mul_(0.02)
        return t.to(dtype) if dtype is not None else t

    def get_slice(self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
        return self.get(name, dtype, device).narrow(dim, start, stop - start)

    def close(self) -> None:
        pass


def load_models(resolved: ResolvedModel, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                comm=None, stats: dict | None = None, random_weights: bool = False):
    """Build and load the target and the MTP layer. Returns (target, mtp, extras).

    target is None when resolved with need='mtp'; mtp is None with need='target'. The MTP layer is
    read from `model.layers.{N}` with N the checkpoint's own depth, even when --layers truncated the
    target. extras: the MTP layer's own `embed_tokens`/`shared_head.head` when the checkpoint has
    them (DeepSeek style; GLM-5 has none and shares the target's).
    comm (parallel.Comm, world > 1): build this rank's shard only and read only its slices.
    stats: when given, gets 'bytes_read' (bytes copied out of the shards).
    random_weights: random tensors of the config's shapes instead of the checkpoint's (RandomReader).
    """
    from glm5mtp_cli.models.glm5 import Glm5ForCausalLM, Glm5MtpLayer

    if not resolved.has_weights and not random_weights:
        raise UserError(f"model '{resolved.spec}' has no weights (config only); "
                        f"make some with `glm5mtp init-random {resolved.spec} DIR`")
    cfg = resolved.config
    if random_weights:
        reader = RandomReader(resolved.source_config or cfg)
    else:
        reader = CheckpointReader(resolved.folder, resolved.weight_map, block=cfg.fp8_block)
    mtp_prefix = f"model.layers.{resolved.mtp_index}."
    wants_target = resolved.need in ("all", "target")
    wants_mtp = resolved.need in ("all", "mtp")
    target = mtp = None
    sharded = comm is not None and comm.world > 1
    try:
        if wants_target:
            with _ParamsOnMeta():
                target = Glm5ForCausalLM(cfg)
            plan = None
            if sharded:
                from glm5mtp_cli.engine.parallel import shard_target

                plan = shard_target(target, comm)
            load_module(target, reader, "", dtype, device, plan)
            target.to(device)  # the non-persistent buffers; parameters are already there
            _check_no_meta(target, "target")
        if wants_mtp:
            with _ParamsOnMeta():
                mtp = Glm5MtpLayer(cfg)
            plan = None
            if sharded:
                from glm5mtp_cli.engine.parallel import shard_mtp

                plan = shard_mtp(mtp, comm, mtp_prefix)
            load_module(mtp, reader, mtp_prefix, dtype, device, plan)
            mtp.to(device)
            _check_no_meta(mtp, "MTP layer")
        extras = {k: reader.get(mtp_prefix + k, dtype, device) for k in _MTP_EXTRAS if reader.has(mtp_prefix + k)}
        if stats is not None:
            stats["bytes_read"] = reader.bytes_read
    finally:
        reader.close()
    return target, mtp, extras
