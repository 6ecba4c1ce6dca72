"""DSL benchmark: the RAG program through ``radixserve.frontend``, and the cost of constrained decoding.

1. RAG: one document, 16 questions forked after it, run through ``rf.RuntimeEndpoint`` against
   ``radixserve serve`` with the prefix cache on, then against a second server with it off (one
   server at a time). Reports wall time and the branches' cached tokens.
2. Constraints: decode throughput at batch 16, unconstrained vs JSON-schema constrained (through
   the in-process engine: the constrained run is only enforced once the engine applies
   ``radixserve.sampling.grammar``), and the grammar's own per-step cost measured in isolation
   (mask for 16 matchers + applying it + accepting the tokens), as a share of a decode step.

Writes benchmarks/results/dsl_bench.{json,md}.

    python -m benchmarks.serving.dsl_bench            # the embedded SmolLM2-135M
    python -m benchmarks.serving.dsl_bench --smoke --out /tmp/dsl   # tiny sizes, to check it runs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx
import torch

import radixserve.frontend as rf
from benchmarks.lib.common import RESULTS, write_results
from benchmarks.lib.servers import free_port, radixserve_command, serving

DOC = (
    "Radix trees store strings by their shared prefixes: each edge holds a run of characters, and a node "
    "branches only where stored strings diverge. An inference server keys the tree by token ids and stores "
    "pages of attention keys and values at its nodes, so a request whose prompt starts like an earlier one "
    "reuses the computed pages and prefills only the rest. "
) * 6
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "score", "tags"],
    "additionalProperties": False,
}


@rf.function
def rag(s: rf.ProgramState, questions: list[str], max_tokens: int) -> None:
    s += rf.system("Answer in one sentence from the document.") + rf.user(DOC)
    forks = s.fork(len(questions))
    for f, q in zip(forks, questions, strict=True):
        f += rf.user(q) + rf.assistant(rf.gen("a", max_tokens=max_tokens, temperature=0))
    s["cached"] = [f.get_meta_info("a")["cached_tokens"] for f in forks]
    s["prompt"] = [f.get_meta_info("a")["prompt_tokens"] for f in forks]


def bench_rag(
    model: str | None, prefix_cache: bool, questions: int, max_tokens: int, repeats: int
) -> dict[str, Any]:
    port = free_port()
    cmd = radixserve_command(port, *([] if prefix_cache else ["--no-prefix-cache"]), model=model)
    with serving("radixserve", cmd, port, RESULTS / "logs") as url:
        backend = rf.RuntimeEndpoint(url)
        qs = [f"Question {i}: what does the document say about point {i}?" for i in range(questions)]
        rag.run(questions=qs[:2], max_tokens=2, backend=backend)  # warm-up
        httpx.post(f"{url}/flush_cache", timeout=30)
        times, state = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = rag.run(questions=qs, max_tokens=max_tokens, backend=backend)
            times.append(time.perf_counter() - t0)
            httpx.post(f"{url}/flush_cache", timeout=30)
        backend.close()
        assert state is not None
        return {
            "prefix_cache": prefix_cache,
            "questions": questions,
            "seconds": min(times),
            "all_seconds": times,
            "mean_cached_tokens": sum(state["cached"]) / questions,
            "prompt_tokens": state["prompt"][0],
        }


def bench_constraints(model: str | None, batch: int, max_tokens: int) -> dict[str, Any]:
    from radixserve import Engine, SamplingParams
    from radixserve.sampling.grammar import GrammarCompiler, apply_mask, batch_mask

    engine = Engine(model, kv_cache_gb=0.25)
    prompts = [
        engine.apply_chat_template([{"role": "user", "content": f"Describe item {i} as JSON."}])
        for i in range(batch)
    ]
    out: dict[str, Any] = {"batch": batch, "max_tokens": max_tokens}
    for name, schema in (("unconstrained", None), ("json_schema", SCHEMA)):
        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.8, seed=0, ignore_eos=schema is None, json_schema=schema
        )
        engine.generate(prompts[:2], SamplingParams(max_tokens=2))
        steps0, t0 = engine.num_steps, time.perf_counter()
        res = engine.generate(prompts, params)
        dt = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for r in res)
        out[name] = {
            "tokens_per_s": tokens / dt,
            "steps": engine.num_steps - steps0,
            "seconds": dt,
            "ms_per_step": dt * 1000 / max(1, engine.num_steps - steps0),
        }
    # The grammar's share of a step, measured alone: mask 16 matchers, apply it, accept a token each.
    compiler = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size)
    matchers = [compiler.matcher(SamplingParams(json_schema=SCHEMA)) for _ in range(batch)]
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    t_mask, steps = 0.0, 0
    for _ in range(max_tokens):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        mask = batch_mask(matchers, vocab)
        apply_mask(logits, mask)
        picked = logits.argmax(-1).tolist()
        for m, t in zip(matchers, picked, strict=True):
            if not m.is_terminated():
                m.accept(t)
        t_mask += time.perf_counter() - t0
        steps += 1
    compiler.shutdown()
    out["mask_ms_per_step"] = t_mask * 1000 / steps
    out["mask_overhead_pct"] = 100 * out["mask_ms_per_step"] / out["unconstrained"]["ms_per_step"]
    return out


def report(results: dict[str, Any]) -> str:
    """The results as Markdown: the RAG program's table and the constraints' cost."""
    lines = [
        "# DSL benchmark",
        "",
        f"model: {results['model']}",
        "",
        "## RAG program (1 document, fork into questions)",
        "",
        "| prefix cache | questions | seconds | mean cached tokens / branch | prompt tokens / branch |",
        "|---|---|---|---|---|",
    ]
    for r in results["rag"]:
        lines.append(
            f"| {'on' if r['prefix_cache'] else 'off'} | {r['questions']} | {r['seconds']:.2f} | "
            f"{r['mean_cached_tokens']:.0f} | {r['prompt_tokens']} |"
        )
    c = results["constraints"]
    lines += ["", f"## Decode at batch {c['batch']}", "", "| run | tokens/s | ms/step |", "|---|---|---|"]
    for name in ("unconstrained", "json_schema"):
        lines.append(f"| {name} | {c[name]['tokens_per_s']:.1f} | {c[name]['ms_per_step']:.1f} |")
    lines += [
        "",
        f"Grammar cost per step (mask + apply + accept, 16 JSON matchers): {c['mask_ms_per_step']:.2f} ms "
        f"= {c['mask_overhead_pct']:.1f}% of an unconstrained decode step (target <= 5%).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks that the benchmark runs")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where dsl_bench.{json,md} go")
    args = ap.parse_args(argv)
    if args.smoke:
        args.questions, args.max_tokens, args.repeats = 4, 4, 1
    results: dict[str, Any] = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "smoke": args.smoke}
    results["rag"] = [
        bench_rag(args.model, on, args.questions, args.max_tokens, args.repeats) for on in (True, False)
    ]
    results["constraints"] = bench_constraints(args.model, 16, args.max_tokens if not args.smoke else 8)
    write_results("dsl_bench", results, out_dir=args.out, markdown=report(results))


if __name__ == "__main__":
    main()
