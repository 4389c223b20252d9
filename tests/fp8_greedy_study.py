"""Greedy agreement on glm5-nano's 8 prompts (64 new tokens) between the FP8-resident run and its
twin, and between runs of the SAME weights that differ only in kernel shapes (batch 1 vs 8, CUDA
graphs vs eager): how often bf16 greedy decoding splits at all, and where (the fp32 twin's margin
between the two tokens at each first split, over the largest logit). Prints one JSON document.

    PYTHONPATH=. python3 tests/fp8_greedy_study.py > greedy_study.json   (a CUDA machine)

DEV=cpu NEW=8 is a smoke run of the script on the CPU (eager only: the graph and eager rows coincide).
"""
import itertools
import os
import json
import sys
import tempfile
from pathlib import Path

import torch

from glm5mtp_cli.checkpoint.resolve import profile_path
from glm5mtp_cli.checkpoint.write import rewrite_checkpoint
from glm5mtp_cli.engine.run import run_generate
from glm5mtp_cli.engine.runtime import load_runtime
from glm5mtp_cli.engine.sampling import SamplingParams
from glm5mtp_cli.prompts import encode_prompts, read_file

NEW = int(os.environ.get("NEW", 64))
DEV = os.environ.get("DEV", "cuda")
G = "cuda" if DEV == "cuda" else "eager"
tmp = Path(tempfile.mkdtemp())
q, twin = tmp / "q", tmp / "twin"
rewrite_checkpoint("glm5-nano", q, fp8=True)
rewrite_checkpoint(str(q), twin, fp8=False)
rts = {"fp8": load_runtime(str(q), device=DEV, dtype="bf16", progress=False),
       "twin16": load_runtime(str(twin), device=DEV, dtype="bf16", progress=False),
       "twin32": load_runtime(str(twin), device=DEV, dtype="fp32", progress=False)}
prompts = encode_prompts(read_file(profile_path("glm5-nano") / "prompts.jsonl"), rts["fp8"].tokenizer)


def greedy(rt, batch, graphs):
    res, *_ = run_generate(rt, prompts, gamma=0, max_new_tokens=NEW, sampling=SamplingParams(), batch_size=batch,
                           max_seq_len=1024, alloc="budget", draft_conf_tau=None, ignore_eos=True, graphs=graphs)
    return [r.tokens for r in res]


runs = {}
for name in ("fp8", "twin16"):
    for batch, graphs in ((1, G), (8, G), (1, "eager")):
        runs[f"{name}_b{batch}_{graphs}"] = greedy(rts[name], batch, graphs)
runs["twin32_b1_cuda"] = greedy(rts["twin32"], 1, G)


@torch.no_grad()
def margin(prefix, a, b):
    """fp32 twin's logits after prefix: (l[a] - l[b]) and the top-2 gap, both over max |l|."""
    logits = rts["twin32"].target(torch.tensor([prefix], device=DEV), [None]).logits[0, -1].float()
    top = logits.topk(2).values
    peak = logits.abs().max()
    return {"a_minus_b": ((logits[a] - logits[b]) / peak).item(), "top2_gap": ((top[0] - top[1]) / peak).item()}


pairs = {}
for x, y in itertools.combinations(runs, 2):
    equal = sum(s == t for s, t in zip(runs[x], runs[y]))
    splits = []
    if {x, y} in ({"fp8_b1_cuda", "twin16_b1_cuda"}, {"twin16_b1_cuda", "twin16_b8_cuda"},
                  {"twin16_b1_cuda", "twin32_b1_cuda"}, {"fp8_b1_cuda", "twin32_b1_cuda"}):
        for p, (s, t) in enumerate(zip(runs[x], runs[y])):
            if s != t:
                i = next(j for j in range(NEW) if s[j] != t[j])
                splits.append({"prompt": p, "at": i, **margin(prompts[p] + s[:i], s[i], t[i])})
    pairs[f"{x} vs {y}"] = {"equal": equal, "splits": splits}
json.dump({"new_tokens": NEW, "prompts": len(prompts), "pairs": pairs}, sys.stdout, indent=1)
