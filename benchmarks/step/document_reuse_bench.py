"""Document reuse (issue 57) against full prefill, offline, on the real model: accuracy at each share and
the time to a first token.

Each request takes ``--docs-per-request`` of ``--num-docs`` documents (runs of English prose from the
corpus of ``benchmarks/lib/workloads.py``, ``--doc-tokens`` each) in its own order, then asks about a
phrase of one of them. For each share, against full prefill (the reference, greedy):

- top-1 agreement over the answer tokens: the reference's greedy answer teacher-forced after the
  blended documents (``prompt_logprobs`` from the answer's first token), each position's top token
  compared with the reference's;
- mean |Δ logprob| of the reference answer's tokens, teacher-forced;
- the share of greedy answers that are identical.

Then the time to the first token of each request (max_tokens 1, the documents' chunks already cached,
a fresh exact prefix each time: a nonce heads every prompt) with reuse at each share and with the
prefix cache alone, alternating, in one process.

``python -m benchmarks.step.document_reuse_bench [--requests 16] [--shares 0,0.05,0.15,0.3]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from benchmarks.lib.common import write_results
from benchmarks.lib.workloads import Corpus
from radixserve import Engine, SamplingParams


def build(engine: Engine, args: argparse.Namespace) -> list[tuple[list[int], list[list[int]]]]:
    """The requests: (prompt ids, its documents' ids), every piece tokenized on its own."""
    tok = engine.tokenizer
    corpus = Corpus(tok)
    rng = random.Random(args.seed)
    docs_text = [corpus.text(p, args.doc_tokens) for p in corpus.distinct_paragraphs(rng, args.num_docs)]
    docs = [tok.encode(d, add_special_tokens=False) for d in docs_text]

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    out = []
    for _ in range(args.requests):
        picked = rng.sample(range(args.num_docs), args.docs_per_request)
        about = rng.choice(picked)
        prompt = enc("<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n")
        for i in picked:
            prompt += enc("Document:\n") + docs[i] + enc("\n\n")
        phrase = corpus.phrase(rng, docs_text[about])
        prompt += enc(f'What does the document say about "{phrase}"?<|im_end|>\n<|im_start|>assistant\n')
        out.append((prompt, [docs[i] for i in picked]))
    return out


def scored(engine: Engine, prompt: list[int], answer: list[int], **kw: Any) -> list[tuple[int, float]]:
    """Each answer token's (top-1 token, logprob of the answer's token), teacher-forced after ``prompt``."""
    start = len(prompt)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_start=start)
    rid = engine.add_request(prompt + answer, params, **kw)
    entries = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.group_id == rid and o.prompt_logprobs is not None:
                entries = o.prompt_logprobs
    assert entries is not None
    rows = []
    for e in entries[start:]:
        assert e is not None
        top = max(e.top.items(), key=lambda kv: kv[1])[0] if e.top else e.token_id
        rows.append((top, e.logprob))
    return rows


def greedy(engine: Engine, prompt: list[int], max_tokens: int, **kw: Any) -> list[int]:
    ids: list[int] = []
    for out in engine.stream(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), **kw):
        ids += out.outputs[0].token_ids
    return ids


def accuracy(
    engine: Engine, reqs: list[tuple[list[int], list[list[int]]]], shares: list[float], n: int
) -> list[dict[str, Any]]:
    refs = [greedy(engine, p, n) for p, _ in reqs]
    ref_scores = [scored(engine, p, a) for (p, _), a in zip(reqs, refs)]
    rows = []
    for share in shares:
        agree = total = same = 0
        deltas: list[float] = []
        for (p, docs), a, ref in zip(reqs, refs, ref_scores):
            engine.flush_cache()  # no exact prefix beyond what a fresh request would find
            got = scored(engine, p, a, documents=docs, document_reuse=share)
            agree += sum(g[0] == r[0] for g, r in zip(got, ref))
            total += len(ref)
            deltas += [abs(g[1] - r[1]) for g, r in zip(got, ref)]
            same += greedy(engine, p, n, documents=docs, document_reuse=share) == a
        rows.append(
            {
                "share": share,
                "top1_agreement": agree / total,
                "mean_abs_dlogprob": statistics.fmean(deltas),
                "identical_greedy": same / len(reqs),
                "answer_tokens": total,
            }
        )
        print(rows[-1], flush=True)
    return rows


def ttft(
    engine: Engine, reqs: list[tuple[list[int], list[list[int]]]], shares: list[float]
) -> dict[str, Any]:
    """Seconds to the first token per request, each mode in turn per request (chunks cached first)."""
    one = SamplingParams(max_tokens=1, temperature=0)
    for p, docs in reqs:  # every chunk computed once, as a server that has seen the documents holds them
        engine.generate([p], one)  # and the prompts' shared head
        engine.add_request(p, one, documents=docs, document_reuse=0.0)
        while engine.has_unfinished():
            engine.step()
    times: dict[str, list[float]] = {"prefix-only": [], **{f"reuse {s:g}": [] for s in shares}}
    for i, (p, docs) in enumerate(reqs):
        for mode in times:
            kw: dict[str, Any] = {}
            if mode != "prefix-only":
                kw = {"documents": docs, "document_reuse": float(mode.split()[1])}
            # a fresh exact prefix after the shared head, as a request with other neighbours has
            nonce = engine.tokenizer.encode(f"[{i} {mode}]", add_special_tokens=False)
            start = time.perf_counter()
            engine.add_request(p[:16] + nonce + p[16:], one, **kw)
            while engine.has_unfinished():
                engine.step()
            times[mode].append(time.perf_counter() - start)
    return {
        m: {"p50": statistics.median(t), "p95": sorted(t)[max(0, round(0.95 * len(t)) - 1)]}
        for m, t in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--num-docs", type=int, default=12)
    ap.add_argument("--docs-per-request", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--shares", default="0,0.05,0.15,0.3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="document_reuse_bench")
    args = ap.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    engine = Engine(kv_cache_gb=0.5)
    reqs = build(engine, args)
    acc = accuracy(engine, reqs, shares, args.answer_tokens)
    speed = ttft(engine, reqs, shares)
    table = []
    for r in acc:
        t = speed[f"reuse {r['share']:g}"]
        table.append(
            [
                f"{r['share']:.0%}",
                f"{r['top1_agreement']:.1%}",
                f"{r['mean_abs_dlogprob']:.3f}",
                f"{r['identical_greedy']:.0%}",
                f"{t['p50']:.3f} / {t['p95']:.3f}",
            ]
        )
    base = speed["prefix-only"]
    table.append(["prefix-only", "100%", "0", "100%", f"{base['p50']:.3f} / {base['p95']:.3f}"])
    header = ["share", "top-1 agreement", "mean \\|Δ logprob\\|", "identical greedy", "TTFT p50 / p95 s"]
    write_results(
        args.name,
        {"args": vars(args), "accuracy": acc, "ttft": speed},
        table,
        header,
        "Document reuse against full prefill (SmolLM2-135M, offline)",
    )


if __name__ == "__main__":
    main()
