"""Which requests hold a continuous run's tail: each request's verify steps, from a `generate --trace`
file (one row per request and step).

    python3 -m glm5mtp_cli.diagnostics.trace_steps steps.jsonl [--slots 64]

Prints one JSON object: the requests (those that took a step: one ended by its prefill has no
row), their mean steps, the slowest five (request, steps), each
request's steps in request order, and the steps of a schedule that admits the requests in that
order, each the moment one of `slots` slots frees. That schedule is the fewest steps a continuous
run of these requests in this order can take; a run's measured steps beside it say what admission
costs beyond what the requests themselves take, and the slowest requests what is left.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter
from pathlib import Path


def steps_per_request(rows) -> dict[int, int]:
    """Verify steps of each request id, from trace rows (dicts with a 'request')."""
    return dict(Counter(row["request"] for row in rows))


def greedy_schedule(steps: list[int], slots: int) -> int:
    """Steps until the last request ends when each, in order, takes the first slot to free up."""
    ends = [0] * min(slots, len(steps))
    for s in steps:
        heapq.heapreplace(ends, ends[0] + s)
    return max(ends, default=0)


def summarize(rows, slots: int) -> dict:
    per = steps_per_request(rows)
    order = [per[r] for r in sorted(per)]
    return {"requests": len(per), "mean_steps": round(sum(order) / len(order), 2) if order else 0.0,
            "slowest": sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))[:5], "slots": slots,
            "schedule_steps": greedy_schedule(order, slots), "steps": order}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a `generate --trace` file")
    ap.add_argument("--slots", type=int, default=64, help="slots of the schedule (default 64)")
    args = ap.parse_args(argv)
    if args.slots < 1:
        print("--slots must be at least 1", file=sys.stderr)
        return 2
    try:
        with args.trace.open() as f:
            doc = summarize([json.loads(line) for line in f if line.strip()], args.slots)
    except OSError as e:
        print(f"{args.trace}: {e.strerror}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError) as e:
        print(f"{args.trace}: not a `generate --trace` file ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
