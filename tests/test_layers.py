"""The layers: the model families do not import the engine, the engine imports no family, and what
both need (glm5mtp_cli/core) imports neither. Every import counts, at any depth (one inside a function
is still a dependency, only a later one)."""

from __future__ import annotations

import ast
from pathlib import Path

import glm5mtp_cli

PACKAGE = Path(glm5mtp_cli.__file__).parent
# a layer -> the packages its modules must not import
FORBIDDEN = {"engine": ("glm5mtp_cli.models",),
             "models": ("glm5mtp_cli.engine",),
             "core": ("glm5mtp_cli.engine", "glm5mtp_cli.models")}


def imported(text: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in a module of `package`, relative ones made absolute."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return out


def wrong_way(layer: str) -> list[str]:
    """'file:line: imports module' for each import of a package `layer` must not import."""
    out = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        name = path.relative_to(PACKAGE.parent)
        for line, module in imported(path.read_text(), ".".join(name.parts[:-1])):
            if any(module == p or module.startswith(p + ".") for p in FORBIDDEN[layer]):
                out.append(f"{name}:{line}: imports {module}")
    return out


def test_models_do_not_import_the_engine():
    assert wrong_way("models") == []


def test_engine_imports_no_model_family():
    assert wrong_way("engine") == []


def test_core_imports_neither_layer():
    assert wrong_way("core") == []


def test_imports_inside_functions_and_relative_ones_count():
    text = "def f():\n    from glm5mtp_cli.engine.cache import CachePools\n    from ...engine import cache\n"
    assert imported(text, "glm5mtp_cli.models.glm5") == [(2, "glm5mtp_cli.engine.cache.CachePools"),
                                                         (3, "glm5mtp_cli.engine.cache")]
