"""The naive baseline of the comparison: HF transformers ``generate`` in-process, static batches of
``batch_size`` sessions, turn by turn, no reuse between requests. Offline: every request of a batch
is there when the batch starts, and its latencies count from the batch start. Its runs have the shape
of ``loadgen.run_benchmark``'s, so they sit in the same tables and plots.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.lib.loadgen import request_row
from benchmarks.lib.metrics import RequestResult, summarize
from benchmarks.lib.workloads import Workload


def hf_generate(
    workload: Workload,
    model_dir: str,
    tokenizer: Any,
    batch_size: int,
    max_duration_s: float,
    max_requests: int,
) -> dict[str, Any]:
    """Static batches of ``batch_size`` sessions through ``model.generate``, turn by turn, no reuse."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    class _StepTimes(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    results: list[RequestResult] = []
    start = time.perf_counter()
    sessions = workload.sessions
    for b in range(0, len(sessions), batch_size):
        batch = list(range(b, min(b + batch_size, len(sessions))))
        for k in range(max(len(sessions[i].turns) for i in batch)):
            live = [i for i in batch if k < len(sessions[i].turns)]
            if time.perf_counter() - start > max_duration_s or len(results) + len(live) > max_requests:
                break
            prompts = [
                tokenizer.apply_chat_template(
                    sessions[i].messages(k), tokenize=False, add_generation_prompt=True
                )
                for i in live
            ]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            new = max(sessions[i].turns[k].max_tokens for i in live)
            steps = _StepTimes()
            sent = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    stopping_criteria=StoppingCriteriaList([steps]),
                )
            finished = time.perf_counter()
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for row, (i, text) in enumerate(zip(live, texts, strict=True)):
                res = RequestResult(
                    i,
                    k,
                    sessions[i].turns[k].kind,
                    sent=sent,
                    finished=finished,
                    chunk_times=list(steps.times),
                    prompt_tokens=int(enc["attention_mask"][row].sum()),
                    output_tokens=new,
                    cached_tokens=0,
                    output_text=text,
                )
                results.append(res)
                sessions[i].answers.append(text)
    meta = {
        "base_url": "in-process",
        "label": "hf-generate",
        "mode": "closed",
        "concurrency": batch_size,
        "request_rate": None,
        "scenario": "steady",
        "model": model_dir,
        "workload": workload.describe(),
    }
    summary = summarize(results)
    summary.update(arrival_lag_p99_ms=None, timed_out=False)
    return {"meta": meta, "summary": summary, "requests": [request_row(r, start) for r in results]}
