"""The CLI with CUDA's sync debugging on: how often each line of glm5mtp synchronized the host with
the device (a decode step should do it once, in its accept), by its innermost three frames of
glm5mtp or kernels code, printed to stderr at the end.

    python3 tests/sync_count.py generate --model glm5-nano --device cuda --prompts P.jsonl --batch-size 64 --gamma 3
"""

from __future__ import annotations

import collections
import runpy
import sys
import traceback
import warnings

import torch

counts: collections.Counter = collections.Counter()


def count(message, category, filename, lineno, file=None, line=None) -> None:
    if "synchroniz" not in str(message):
        return
    ours = [f for f in traceback.extract_stack()[:-1] if "glm5mtp_cli" in f.filename or "/kernels/" in f.filename]
    where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in reversed(ours[-3:]))
    counts[where or f"{filename}:{lineno}"] += 1


def main() -> None:
    warnings.showwarning = count
    warnings.simplefilter("always")
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(1)
    sys.argv = ["glm5mtp", *sys.argv[1:]]
    try:
        runpy.run_module("glm5mtp_cli.cli", run_name="__main__")
    except SystemExit:
        pass
    finally:
        for where, n in counts.most_common(60):
            print(f"{n:7d} {where}", file=sys.stderr)


if __name__ == "__main__":
    main()
