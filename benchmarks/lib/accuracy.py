"""Accuracy of a served mode against a reference, through the server's own API: echo-logprob scoring.

Each text of ``TEXTS`` goes through ``/v1/completions`` with ``echo``, ``logprobs: 1`` and
``max_tokens: 0`` (``score``); per prompt token the server gives the token's loglik and its top-1
next token. ``agreement`` compares two servers' scores of the same texts: mean and max |d loglik| per
token, and the fraction of positions whose greedy top-1 agrees. The maths (``agreement``) is pure, so
tests check it on synthetic scores; ``mode_bench`` and ``accuracy_bench`` share all of it.
``offline_scores`` gives the same scores through an in-process engine's offline API.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.servers import SERVED_NAME, free_port, radixserve_command, serving
from radixserve import Engine, SamplingParams

# The fixed text set: plain prose of several kinds (narrative, technical, instructions, dialogue,
# code, numbers), each a few sentences; scored as prompts, never generated from.
TEXTS = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could "
    "see the fishing boats returning to the harbour, their lanterns swaying with the swell. He lit the "
    "great lamp, wrote the weather in his logbook, and waited for the night to pass.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, chlorophyll absorbs "
    "mostly blue and red light, and the energy drives the splitting of water into oxygen, protons and "
    "electrons. The Calvin cycle then fixes carbon dioxide into three-carbon sugars.",
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, seven grams "
    "of dried yeast and three hundred and fifty millilitres of warm water. Knead for ten minutes, let the "
    "dough rise for an hour, shape it, and bake at two hundred and twenty degrees for thirty minutes.",
    "User: Can you recommend a good book about the history of mathematics?\nAssistant: A popular choice "
    "is a survey that starts with Babylonian tablets and Greek geometry, then follows algebra through the "
    "Islamic world to the calculus of Newton and Leibniz.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "The committee met on Tuesday to review the quarterly budget. Spending on maintenance rose by twelve "
    "percent, mostly because of repairs to the north bridge, while income from parking fees fell slightly. "
    "The chair asked for a revised plan before the next meeting.",
    "Mount Everest, known in Nepali as Sagarmatha, is Earth's highest mountain above sea level. It lies in "
    "the Mahalangur Himal range of the Himalayas, and the border between China and Nepal runs across its "
    "summit. Its height was most recently established as 8,848.86 metres.",
    "Once upon a time, a small fox lived at the edge of a great forest. Every morning she ran down to the "
    "river to drink, and every morning the heron standing in the shallows told her a new story about the "
    "lands beyond the hills.",
)


@dataclass
class Scored:
    """One text as a server scored it: each prompt token's loglik and the top-1 next token there."""

    tokens: list[str]
    logliks: list[float]  # log P(token i | tokens before it), i >= 1
    top1: list[str]  # the most likely token at position i, i >= 1


def score(url: str, model: str, texts: tuple[str, ...] | list[str]) -> list[Scored]:
    """Score ``texts`` through ``url``'s /v1/completions (echo + logprobs, no new tokens). A server
    that refuses ``max_tokens: 0`` is asked for one new token, which is then dropped."""
    body = {"model": model, "prompt": list(texts), "max_tokens": 0, "echo": True, "logprobs": 1}
    extra = 0
    if "choices" not in (answer := _post(url, body)):
        extra = 1
        if "choices" not in (answer := _post(url, {**body, "max_tokens": 1, "temperature": 0})):
            raise RuntimeError(f"scoring failed: {answer}")
    return [parse_choice(c["logprobs"], extra) for c in sorted(answer["choices"], key=lambda c: c["index"])]


def parse_choice(lp: dict[str, Any], generated: int = 0) -> Scored:
    """One choice's echoed logprobs, without its last ``generated`` (new, not prompt) tokens. The first
    token has no loglik (nothing before it)."""
    end = len(lp["tokens"]) - generated
    tops = [max(t.items(), key=lambda kv: kv[1])[0] for t in lp["top_logprobs"][1:end]]
    return Scored(lp["tokens"][:end], [float(x) for x in lp["token_logprobs"][1:end]], tops)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    with httpx.Client(base_url=url, trust_env=False, timeout=300) as http:
        answer: dict[str, Any] = http.post("/v1/completions", json=body).json()
    return answer


@dataclass
class Agreement:
    tokens: int  # prompt tokens compared (all texts)
    mean_abs_dloglik: float  # mean over tokens of |loglik_test - loglik_ref|, nats
    max_abs_dloglik: float
    top1_agreement: float  # fraction of positions whose top-1 next token is the same


def agreement(ref: list[Scored], test: list[Scored]) -> Agreement:
    """How closely ``test``'s scores of the same texts follow ``ref``'s."""
    deltas: list[float] = []
    same = 0
    for r, t in zip(ref, test, strict=True):
        if r.tokens != t.tokens:
            raise ValueError("the two servers tokenized a text differently")
        deltas.extend(abs(a - b) for a, b in zip(r.logliks, t.logliks, strict=True))
        same += sum(a == b for a, b in zip(r.top1, t.top1, strict=True))
    return Agreement(len(deltas), sum(deltas) / len(deltas), max(deltas), same / len(deltas))


MIN_TOKENS = 400  # issue 21: accuracy over at least 400 scored tokens
HEADER = ["mode", "versus", "tokens", "mean abs d loglik", "max abs d loglik", "top-1 agreement %", "note"]


def compare_scores(ref: list[Scored], test: list[Scored]) -> dict[str, Any]:
    """``agreement`` as JSON, or why the two cannot be compared (they tokenized a text differently)."""
    try:
        acc = agreement(ref, test)
    except ValueError as exc:
        return {"error": str(exc)}
    out = asdict(acc)
    out["enough_tokens"] = acc.tokens >= MIN_TOKENS
    return out


def table_row(name: str, versus: str, acc: dict[str, Any]) -> list[Any]:
    if "error" in acc:
        return [name, versus, "", "", "", "", acc["error"]]
    note = "" if acc["enough_tokens"] else f"fewer than {MIN_TOKENS} tokens"
    return [
        name,
        versus,
        acc["tokens"],
        acc["mean_abs_dloglik"],
        acc["max_abs_dloglik"],
        100 * acc["top1_agreement"],
        note,
    ]


def chunk_flags(chunk_tokens: int | None) -> list[str]:
    """Flags that cap the tokens of a step at ``chunk_tokens``, so that a prompt is prefilled in chunks
    and its later positions attend to K/V read back from the pool (at the mode's KV dtype), as in
    serving."""
    if not chunk_tokens:
        return []
    # A chunk's products take --prefill-arithmetic's cheaper copy only above --max-running-requests
    # rows (model/arithmetic.py): 8 keeps every chunk of 32 above it, as a served prefill would be.
    return ["--max-batched-tokens", str(chunk_tokens), "--max-running-requests", "8"]


def served_scores(
    name: str,
    flags: list[str],
    log_dir: Path,
    threads: int | None = None,
    chunk_tokens: int | None = None,
    texts: tuple[str, ...] = TEXTS,
) -> list[Scored]:
    """Serve the default model with ``flags`` (its log: ``log_dir/name.log``), score ``texts``, stop it."""
    port = free_port()
    cmd = radixserve_command(port, *chunk_flags(chunk_tokens), *flags, kv_cache_gb=0.25, threads=threads)
    with serving(name, cmd, port, log_dir) as url:
        return score(url, SERVED_NAME, texts)


def offline_scores(engine: Engine, texts: tuple[str, ...] = TEXTS) -> list[Scored]:
    """Each text's prompt-token logliks and top-1 next tokens through ``engine``'s own offline API (the
    same numbers ``/v1/completions`` echo returns); tokens as ids, in text form, for ``agreement``."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = []
    for result in engine.generate(list(texts), params):
        lps = result.prompt_logprobs or []
        rest = [lp for lp in lps[1:] if lp is not None]  # the first token has nothing before it
        tops = [str(max(lp.top.items(), key=lambda kv: kv[1])[0]) if lp.top else "" for lp in rest]
        out.append(Scored([str(t) for t in result.prompt_token_ids], [lp.logprob for lp in rest], tops))
    return out
