"""Ready-to-paste speculative settings for the serving engines, from a plan's chosen gamma: vLLM's
--speculative-config JSON, SGLang's launch flags, TensorRT-LLM's speculative_config YAML. Option
names as each engine's docs spell them (the URL beside each template); check them against the version
you run.
"""

from __future__ import annotations

import json

# https://docs.vllm.ai/en/latest/features/speculative_decoding/mtp/ : speculative_config
# {"method": "mtp", "num_speculative_tokens": N}
VLLM_DOC = "https://docs.vllm.ai/en/latest/features/speculative_decoding/mtp/"
# https://docs.sglang.io/basic_usage/glm45.html (GLM's MTP layer served as EAGLE, NEXTN its alias):
# --speculative-algorithm, --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens
SGLANG_DOC = "https://docs.sglang.io/basic_usage/glm45.html"
# https://nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/reference/MTPDecodingConfig.html :
# decoding_type MTP, max_draft_len, draft_len_schedule (batch size -> draft length), max_concurrency
TRTLLM_DOC = "https://nvidia.github.io/TensorRT-LLM/1.3.0rc27/llm-api/reference/MTPDecodingConfig.html"


def chosen_gamma(batches: list[dict]) -> int:
    """The gamma to configure: the best at the smallest batch size planned (where speculation pays most;
    the TensorRT-LLM schedule carries the other batch sizes' choices)."""
    return min(batches, key=lambda b: b["batch_size"])["best_gamma"]


def vllm(gamma: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": gamma})


def sglang(gamma: int) -> str:
    # top-k 1: one chain of gamma drafts, gamma + 1 tokens verified (the chain glm5mtp drafts)
    return (f"--speculative-algorithm EAGLE --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {gamma + 1}")


def trtllm(gamma: int, batches: list[dict], stops_paying_at: int | None) -> str:
    """speculative_config YAML (extra LLM API options): the per-batch-size gamma as draft_len_schedule,
    and max_concurrency where speculation stops paying (break_even_batch: never past what fits)."""
    lines = ["speculative_config:", "  decoding_type: MTP", f"  max_draft_len: {gamma}"]
    if stops_paying_at is not None:
        lines.append(f"  max_concurrency: {max(stops_paying_at - 1, 1)}")
    schedule = ", ".join(f"{b['batch_size']}: {b['best_gamma']}" for b in sorted(batches, key=lambda b: b["batch_size"]))
    lines.append(f"  draft_len_schedule: {{{schedule}}}")
    return "\n".join(lines) + "\n"


def exports(batches: list[dict], stops_paying_at: int | None, fits: int | None) -> dict:
    """{vllm, sglang, trtllm, gamma, docs} from the batch sizes that fit in memory (`fits` sequences per
    GPU; None: no limit); the snippets are None when speculation pays at none of them (leave it off) or
    none fits (nothing to deploy)."""
    docs = {"vllm": VLLM_DOC, "sglang": SGLANG_DOC, "trtllm": TRTLLM_DOC}
    fitting = [b for b in batches if fits is None or b["batch_size"] <= fits]
    if not fitting:
        return {"gamma": None, "vllm": None, "sglang": None, "trtllm": None, "docs": docs,
                "note": f"no batch size planned fits in a GPU's memory (it holds {fits} sequences): no settings"}
    gamma = chosen_gamma(fitting)
    if gamma == 0:
        return {"gamma": 0, "vllm": None, "sglang": None, "trtllm": None, "docs": docs,
                "note": "speculation does not pay at the smallest batch size planned: leave it off"}
    return {"gamma": gamma, "vllm": vllm(gamma), "sglang": sglang(gamma),
            "trtllm": trtllm(gamma, fitting, stops_paying_at), "docs": docs}
