"""Find a model (profile | local folder | Hub repo id) and make the shards a run needs available.

A model is named by a profile shipped in `profiles/`, a local folder holding config.json, or a Hub
repo id fetched through huggingface_hub's cache. Only the shards that hold the tensors a run needs
(target, MTP layer, or both; the first --layers target layers) are downloaded. The config is read
through `models.load_config`, so a config of any registered model family resolves.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5mtp_cli.errors import UserError, short_error
from glm5mtp_cli.core.families import load_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # GLM-5 | GLM-5-Next


# ---- profiles -----------------------------------------------------------------------------------

def profiles_dir() -> Path:
    """The folder of named profiles: the `profiles` package shipped beside glm5mtp_cli."""
    import profiles  # a package so that it installs with the tool

    return Path(profiles.__file__).resolve().parent


def list_profiles() -> list[str]:
    import profiles

    return profiles.names()


def profile_path(name: str) -> Path | None:
    """The folder of profile `name`, or None when no such profile ships."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    p = profiles_dir() / name
    return p if (p / "config.json").is_file() else None


def config_from_spec(spec: str | os.PathLike) -> Any:
    """The config named by a profile, a folder holding config.json, or a config.json path."""
    spec = str(spec)
    p = profile_path(spec)
    if p is None:
        p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserError(f"'{spec}' is neither a profile nor a config.json (or a folder holding one)")
    return load_config(p)


@dataclass
class ResolvedModel:
    spec: str
    kind: str                      # 'profile' | 'local' | 'hub'
    folder: Path
    config: Any                    # the family's config, truncated to --layers when given
    weight_map: dict[str, str]     # needed tensor name -> shard file (relative to folder)
    has_weights: bool
    mtp_index: int                 # the checkpoint's own num_hidden_layers: where the MTP layer lives
    need: str = "all"              # 'all' | 'target' | 'mtp': what weight_map was filtered for
    source_config: Any = field(repr=False, default=None)  # the untruncated config

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def as_fp8(resolved: ResolvedModel) -> ResolvedModel:
    """`resolved` with the family's FP8 layout as GLM-5-FP8 stores it (models/fp8.fp8_config), for
    --fp8 random weights; the random reader draws by the untruncated config (--layers keeps the MTP
    layer's name), so that one too."""
    import dataclasses

    from glm5mtp_cli.models.fp8 import fp8_config  # torch: `info` resolves without it

    source = resolved.source_config
    return dataclasses.replace(resolved, config=fp8_config(resolved.config),
                               source_config=fp8_config(source) if source is not None else None)


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
    """Whether a run with `need` reads tensor `name` (top-level tensors are always needed; a
    multimodal checkpoint's vision tower never is)."""
    if name.startswith("model.visual."):
        return False
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
    cfg = load_config(folder / "config.json")
    full_map = local_weight_map(folder)
    return _finish(spec, kind, folder, cfg, full_map, need, layers, check_files=True)


def resolve_config(spec: str, revision: str | None = None, token: str | None = None) -> tuple[Any, str]:
    """Only the config of `spec` (for `info`): no weights are read or fetched. Returns (config, kind)."""
    folder, kind = _locate(spec)
    if kind == "hub":
        path = _hub_file(spec, "config.json", revision, token, what="config.json")
        return load_config(path), kind
    return load_config(folder / "config.json"), kind


def local_folder(spec: str) -> Path | None:
    """The folder of a profile or a local checkpoint; None for a Hub id (nothing is fetched here)."""
    return _locate(spec)[0]


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
        raise UserError(f"{path}: not a readable safetensors file ({short_error(e)})") from None


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
        raise UserError(f"model '{repo}': Hub error fetching {filename}: {short_error(e)}") from None
    except hub_errors.HFValidationError as e:
        raise UserError(f"model '{repo}' is not a valid Hub repo id ({short_error(e)})") from None
    except OSError as e:
        raise UserError(f"model '{repo}': cannot fetch {filename}: {short_error(e)}") from None


def _resolve_hub(repo, revision, token, need, layers, progress) -> ResolvedModel:
    from huggingface_hub import errors as hub_errors

    cfg_path = _hub_file(repo, "config.json", revision, token, what="config.json")
    folder = cfg_path.parent  # the snapshot folder; shards land beside config.json
    cfg = load_config(cfg_path)
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
