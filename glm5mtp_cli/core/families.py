"""The model families by config.json's model_type, each behind one interface (core/family.ModelFamily).

A family is imported on first use, by its module's name, so resolving a config never pulls in another
family's code, and nothing below the families imports one."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.core.family import ModelFamily

# model_type -> the module whose FAMILY object serves it (or, once registered, the object itself)
_FAMILIES: dict[str, Any] = {"glm_moe_dsa": "glm5mtp_cli.models.glm5.family",
                             "glm5_next": "glm5mtp_cli.models.glm5_next.family",
                             "glm5_next_text": "glm5mtp_cli.models.glm5_next.family"}


def register_family(model_type: str, family: ModelFamily) -> None:
    """Serve `model_type` with `family` (a family outside this package: a plugin, a test's fake)."""
    _FAMILIES[model_type] = family


def family_for(model_type: str | None, source: str = "<config>") -> ModelFamily:
    if model_type not in _FAMILIES:
        raise UserError(f"{source}: field 'model_type' is {model_type!r}; glm5mtp supports "
                        f"{', '.join(_FAMILIES)}")
    family = _FAMILIES[model_type]
    return importlib.import_module(family).FAMILY if isinstance(family, str) else family


def family_of(cfg: Any) -> ModelFamily:
    return family_for(cfg.model_type, cfg.source)


def parse_config(raw: dict[str, Any], source: str = "<dict>") -> Any:
    """The config object of whichever family config.json's model_type names."""
    return family_for(raw.get("model_type"), source).parse_config(raw, source)


def read_config_file(path: str | os.PathLike, error: type[Exception] = UserError) -> dict[str, Any]:
    """config.json as a dict, or one line naming the file (`error` lets a family raise its own class)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: not a JSON object")
    return raw


def load_config(path: str | os.PathLike) -> Any:
    """The config object of a config.json file, parsed by the family its model_type names."""
    return parse_config(read_config_file(path), source=str(path))
