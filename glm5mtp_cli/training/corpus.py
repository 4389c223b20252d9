"""The training corpus: the Python standard library's own `.py` sources, rebuilt offline.

Every machine that runs glm5mtp has a Python, so the corpus needs no download: the files under
`sysconfig.get_paths()["stdlib"]`, minus test suites (`test/`, `tests/`, `idlelib/`), installed
third-party packages (`site-packages/`, `dist-packages/`) and the generated codec tables
(`encodings/`, byte tables that would only teach a small model to memorise hex). Files are taken
in sorted relative-path order and split by FILE: a file is held out when a hash of its relative
path falls in one bucket of `HELDOUT_EVERY`, so the split does not move when other files appear or
disappear. Same Python minor version -> same corpus, byte for byte; `build_corpus` records the
Python version and a sha256 per split in `manifest.json` so two machines can compare.

`packages` adds the `.py` sources of installed packages (for example glm5mtp's own dependencies,
`torch,numpy`) to the TRAIN split only, under `<package>/<relative path>`; the held-out split stays
the stdlib's, so held-out losses compare across runs. Package versions differ between machines, so
the manifest records each package's version.

Besides plain files, `iter_chat_samples` derives chat-formatted examples from the same files
(user: a function's docstring summary, assistant: the function's source), so a model trained on
the corpus has seen the chat template it is prompted with.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Iterator

CORPUS_VERSION = 1
HELDOUT_EVERY = 20
SPLITS = ("train", "heldout")
# Directory names skipped anywhere in a relative path: tests, and code a package vendors from another
# (a corpus holds only the packages it names, so held-out evaluation stays held out).
SKIP_DIRS = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "encodings",
    "_vendor", "vendor", "vendored",
})
# Relative-path prefixes skipped (kept explicit for the brief's `lib2to3/tests`; covered above too).
SKIP_PREFIXES = ("lib2to3/tests/",)

EOS = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def list_files(root: Path | None = None) -> list[str]:
    """Relative posix paths of the corpus files under `root`, sorted."""
    root = Path(root) if root is not None else stdlib_root()
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]  # prune: never walk site-packages
        for name in filenames:
            if not name.endswith(".py"):
                continue
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel.startswith(SKIP_PREFIXES) or not os.path.isfile(os.path.join(dirpath, name)):
                continue
            out.append(rel)
    out.sort()
    return out


def split_of(relpath: str) -> str:
    """'heldout' for one file in HELDOUT_EVERY, chosen by a hash of the relative path; else 'train'."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % HELDOUT_EVERY == 0 else "train"


def read_source(path: Path) -> str:
    """A source file as text: UTF-8 (invalid bytes replaced), newlines normalised to '\\n'."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def package_root(name: str) -> Path:
    """The folder of an installed package; ValueError naming it when it is missing or a lone module."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(f"no installed package named '{name}' (corpus packages must be folders of .py files)")
    return Path(locations[0]).resolve()


def package_versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    """Each package's installed version, found through the distribution that ships it (`_pytest`
    is pytest's)."""
    shipped_by = importlib.metadata.packages_distributions()
    out: dict[str, str | None] = {}
    for name in packages:
        out[name] = None
        for dist in [name] + shipped_by.get(name, []):
            try:
                out[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def _files_under(root: Path, prefix: str, keep, max_files: int | None) -> Iterator[tuple[str, str]]:
    n = 0
    for rel in list_files(root):
        if not keep(rel):
            continue
        if max_files is not None and n >= max_files:
            return
        text = read_source(root / rel)
        if not text.strip():
            continue
        n += 1
        yield prefix + rel, text


def iter_files(split: str, root: Path | None = None, max_files: int | None = None,
               packages: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """(relative path, text) of each file of `split`, in sorted order: the stdlib's, then (train
    split only) each of `packages` in the order given. `max_files` caps the count per source."""
    _check_split(split)
    root = Path(root) if root is not None else stdlib_root()
    yield from _files_under(root, "", lambda rel: split_of(rel) == split, max_files)
    if split == "train":
        for name in packages:
            yield from _files_under(package_root(name), f"{name}/", lambda rel: True, max_files)


def iter_texts(split: str, root: Path | None = None, max_files: int | None = None,
               packages: tuple[str, ...] = ()) -> Iterator[str]:
    """The texts of `split` ('train' or 'heldout'), one per file, in sorted file order."""
    for _, text in iter_files(split, root, max_files, packages):
        yield text


def chat_samples_of(text: str, max_chars: int = 2000) -> list[str]:
    """Chat-formatted samples from one source file: for each function or method with a docstring,
    `<|user|>\\n<docstring summary><|assistant|>\\n<source><|endoftext|>` (the chat template's layout).
    Files that do not parse (Python 2 leftovers, newer syntax) give none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary = doc.strip().split("\n\n")[0].strip()
        if len(summary) < 12:
            continue
        if node.end_lineno is None or node.end_lineno - node.lineno > 60:
            continue
        # The whole lines of the definition, dedented to column 0 (methods sit inside classes).
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        src = textwrap.dedent("".join(lines[first - 1:node.end_lineno])).rstrip()
        if len(src) > max_chars:
            continue
        request = f"Write a Python function `{node.name}`: {summary}"
        out.append(f"{USER}\n{request}{ASSISTANT}\n{src}{EOS}")
    return out


def iter_chat_samples(split: str, root: Path | None = None, max_files: int | None = None,
                      packages: tuple[str, ...] = ()) -> Iterator[str]:
    """Chat samples (see `chat_samples_of`) of every file of `split`, in order."""
    for text in iter_texts(split, root, max_files, packages):
        yield from chat_samples_of(text)


def build_corpus(out_dir: str | Path, root: Path | None = None, max_files: int | None = None) -> dict:
    """Write `train.txt`, `heldout.txt` (files joined by `<|endoftext|>`) and `manifest.json` under
    `out_dir`; return the manifest (Python version, file counts, bytes, sha256 per split)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(root) if root is not None else stdlib_root()
    manifest: dict = {
        "corpus_version": CORPUS_VERSION,
        "source": "python-stdlib",
        "python_version": platform.python_version(),
        "python_minor": f"{sys.version_info.major}.{sys.version_info.minor}",
        "implementation": platform.python_implementation(),
        "heldout_every": HELDOUT_EVERY,
        "skip_dirs": sorted(SKIP_DIRS),
        "splits": {},
    }
    whole = hashlib.sha256()
    for split in SPLITS:
        h = hashlib.sha256()
        files = 0
        nbytes = 0
        with open(out_dir / f"{split}.txt", "w", encoding="utf-8", newline="\n") as f:
            for rel, text in iter_files(split, root, max_files):
                data = text.encode("utf-8")
                for part in (rel.encode("utf-8"), b"\0", data, b"\0"):
                    h.update(part)
                if files:
                    f.write(f"\n{EOS}\n")
                f.write(text)
                files += 1
                nbytes += len(data)
        digest = h.hexdigest()
        whole.update(f"{split}:{digest}\n".encode())
        manifest["splits"][split] = {"files": files, "bytes": nbytes, "sha256": digest,
                                     "path": f"{split}.txt"}
    manifest["sha256"] = whole.hexdigest()
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
