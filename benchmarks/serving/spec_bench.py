"""Speculative decoding (--speculative ngram) against plain decoding: decode tok/s at batch 1 and 8.

Cases, each from the Python reference documentation (benchmarks/lib/workloads.py's corpus):
- ``rag_quote``: a ~300-token document and a request to quote what it says about a phrase (copy-heavy);
- ``rewrite``: "rewrite this paragraph" over a ~200-token paragraph (copy-heavy, with edits);
- ``unique``: open questions with no context to copy from;
- ``regenerate``: a ``unique`` prompt asked again after a first answer (drafts from the radix tree).

Both engines (plain, speculative) are loaded in one process and run each case in turn, round after
round, so they share the machine's state; the figure is the best round. "Batch b" is a steady b
requests in flight: 3b requests are submitted and at most b run at once (so a request that speculates
poorly cannot hold the batch alone at its end, as it would in a closed batch). Prompts are put in the prefix
cache first (1 token each, then the cache holds only the prompt), so the time measured is decoding; the
cache is flushed before each round, so no round drafts from an earlier round's answers (except
``regenerate``, whose first answer is the point). Greedy: both engines emit the same tokens (checked).

    python -m benchmarks.serving.spec_bench [--batches 1,8] [--max-tokens 128] [--rounds 2]

Writes benchmarks/results/spec_bench.{json,md} and spec_bench.png.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.lib.common import RESULTS, write_results
from benchmarks.lib.plots import plot_bars
from benchmarks.lib.workloads import Corpus
from radixserve import Engine, SamplingParams

CASES = ("rag_quote", "rewrite", "unique", "regenerate")
TOPICS = (
    "a lighthouse keeper",
    "the first day of spring",
    "a robot learning to paint",
    "a city under the sea",
    "an old clock",
    "a long train journey",
    "a forgotten garden",
    "a chess game",
)
STYLES = ("a short story", "a poem", "a letter")  # with TOPICS: 24 distinct prompts, none repeated


def prompts(engine: Engine, corpus: Corpus, case: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i, para in enumerate(corpus.distinct_paragraphs(rng, n)):
        if case == "rag_quote":
            doc = corpus.text(para, 300)
            phrase = corpus.phrase(rng, doc, 3)
            ask = f'Quote, word for word, the sentences of the document above that mention "{phrase}".'
            content = f"Document:\n{doc}\n\n{ask}"
        elif case == "rewrite":
            content = (
                f"Rewrite this paragraph, keeping its wording where you can:\n\n{corpus.text(para, 200)}"
            )
        else:
            content = f"Write {STYLES[i // len(TOPICS) % len(STYLES)]} about {TOPICS[i % len(TOPICS)]}."
        out.append(engine.apply_chat_template([{"role": "user", "content": content}]))
    return out


def timed_decode(
    engine: Engine, batch: list[list[int]], params: SamplingParams, regenerate: bool
) -> dict[str, Any]:
    engine.flush_cache()
    engine.generate(batch, SamplingParams(max_tokens=1, temperature=0))  # the prompts into the cache
    if regenerate:
        engine.generate(batch, params)  # the first answers: the tree holds them from now on
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.generate(batch, params)
    seconds = time.perf_counter() - start
    after = engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    steps = after.num_steps - before.num_steps
    verify = after.spec_verify_steps - before.spec_verify_steps
    emitted = after.spec_emitted - before.spec_emitted
    return {
        "tok_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "steps": steps,
        "mean_accepted_length": emitted / verify if verify else None,
        "drafted": sum(after.spec_drafted.values()) - sum(before.spec_drafted.values()),
        "accepted": sum(after.spec_accepted.values()) - sum(before.spec_accepted.values()),
        "token_ids": [o.token_ids for o in outs],
    }


def run(batches: Sequence[int], max_tokens: int, rounds: int, k: int) -> dict[str, Any]:
    engines = {"plain": Engine(), "speculative": Engine(speculative="ngram", num_speculative_tokens=k)}
    corpus = Corpus(engines["plain"].tokenizer)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    rows = []
    for case in CASES:
        for batch_size in batches:
            batch = prompts(engines["plain"], corpus, case, 3 * batch_size, seed=batch_size)
            best: dict[str, dict[str, Any]] = {}
            for _ in range(rounds):
                for name, engine in engines.items():
                    engine.scheduler.max_running = batch_size  # --max-running-requests, set per case
                    r = timed_decode(engine, batch, params, case == "regenerate")
                    if name not in best or r["tok_s"] > best[name]["tok_s"]:
                        best[name] = r
            identical = best["plain"]["token_ids"] == best["speculative"]["token_ids"]
            for r in best.values():
                del r["token_ids"]
            row = {
                "case": case,
                "batch": batch_size,
                "plain": best["plain"],
                "speculative": best["speculative"],
                "speedup": best["speculative"]["tok_s"] / best["plain"]["tok_s"],
                "greedy_identical": identical,
            }
            rows.append(row)
            print(
                f"{case} b={batch_size}: plain {best['plain']['tok_s']:.1f} tok/s, "
                f"spec {best['speculative']['tok_s']:.1f} tok/s ({row['speedup']:.2f}x), "
                f"accepted length {best['speculative']['mean_accepted_length']}, identical={identical}"
            )
    return {"max_tokens": max_tokens, "rounds": rounds, "num_speculative_tokens": k, "rows": rows}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="--num-speculative-tokens")
    args = ap.parse_args(argv)
    doc = run([int(b) for b in args.batches.split(",")], args.max_tokens, args.rounds, args.k)
    table = [
        [
            r["case"],
            r["batch"],
            r["plain"]["tok_s"],
            r["speculative"]["tok_s"],
            f"{r['speedup']:.2f}x",
            r["speculative"]["mean_accepted_length"] or "-",
            f"{r['speculative']['accepted']}/{r['speculative']['drafted']}",
            "yes" if r["greedy_identical"] else "NO",
        ]
        for r in doc["rows"]
    ]
    header = [
        "case",
        "batch",
        "plain tok/s",
        "spec tok/s",
        "speedup",
        "accepted length",
        "accepted/drafted",
        "identical",
    ]
    write_results(
        "spec_bench", doc, table, header, "Speculative decoding (ngram + radix tree) vs plain, greedy decode"
    )
    values = {
        f"{r['case']} b{r['batch']}": {"plain": r["plain"]["tok_s"], "speculative": r["speculative"]["tok_s"]}
        for r in doc["rows"]
    }
    plot_bars(values, RESULTS / "spec_bench.png", "decode tok/s", "Speculative decoding vs plain (greedy)")


if __name__ == "__main__":
    main()
