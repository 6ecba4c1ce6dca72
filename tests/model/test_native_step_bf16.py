"""The native decode step over bf16 weights (``--dtype bfloat16``), an approximate mode, against the
torch bf16 step it replaces.

The native step rounds each product's activations to bf16 and keeps everything between the products
in fp32; the torch bf16 model rounds every activation to bf16. So the two differ by bf16 rounding, and
the bounds are stated against that:

- logits: within ``LOGIT_BOUND`` (0.05, absolute) of the torch bf16 step at every decode step, on tiny
  random models whose logits reach ~2.5 (measured: up to 0.027; the LM head's own bf16 output
  rounding is 0.008 there);
- against the fp32 model: no further than the torch bf16 step is (x1.25 + 0.01, over all steps);
- greedy tokens: equal to the torch bf16 step's wherever that step's top-2 gap exceeds twice the
  bound (where it does not, a bf16 rounding may pick either); the agreement rate over all rows is
  printed, and on the real model asserted.

Steps: 8 prefills (torch in every runner), then decode steps of 1, 3 and 8 rows, each run 4 times,
teacher-forced with the torch bf16 runner's greedy tokens so the runners see the same sequences.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.cache.page_pool import KVPool
from radixserve.kernels import cpu_build
from radixserve.model import native_step
from radixserve.model.attention import get_backend
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk

if not cpu_build.load() or cpu_build.isa() not in native_step.ISAS:
    pytest.skip("no C++ CPU kernels with AVX-512 or AVX2: no native step", allow_module_level=True)

needs_bf16_dot = pytest.mark.skipif(
    not native_step.bf16_dot_here(), reason="this CPU (or build) has no AVX512_BF16: bf16 runs in torch"
)
LOGIT_BOUND = 0.05
CPU = torch.device("cpu")


def _runner(path: Path, dtype: torch.dtype, native: bool, kv_dtype: str) -> ModelRunner:
    model = load_model(path, dtype, CPU)
    c = model.config
    pool = KVPool(c.num_layers, 400, 4, c.num_kv_heads, c.head_dim, kv_dtype)
    runner = ModelRunner(model, pool, get_backend("cpu"), CPU, False, native_step=native)
    assert (runner.native is not None) == native
    return runner


def _chunks(seqs: list[list[int]], pages: list[list[int]], rows: list[int]) -> list[SeqChunk]:
    return [SeqChunk(list(seqs[i]), len(seqs[i]) - 1, 1, pages[i]) for i in rows]


@needs_bf16_dot
@pytest.mark.parametrize(
    ("kind", "kv_dtype"),
    [("llama", "bfloat16"), ("llama", "float32"), ("qwen2", "bfloat16"), ("qwen3", "bfloat16")],
)
def test_bf16_native_step_is_within_bf16_rounding_of_the_torch_bf16_step(
    tiny_models: dict[str, Path], kind: str, kv_dtype: str
) -> None:
    fp32 = _runner(tiny_models[kind], torch.float32, False, kv_dtype)
    torch_bf16 = _runner(tiny_models[kind], torch.bfloat16, False, kv_dtype)
    native = _runner(tiny_models[kind], torch.bfloat16, True, kv_dtype)
    assert native.model.get_submodule("layers.0.mlp.down_proj").weight.dtype == torch.bfloat16
    calls = 0
    forward = native.native.forward if native.native is not None else None

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        assert forward is not None
        return forward(*args)

    native.native.forward = counted  # type: ignore[method-assign,assignment,union-attr]
    vocab = fp32.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 30, 17, 5, 12, 3, 21, 8)]
    pages = [list(range(1 + 40 * i, 41 + 40 * i)) for i in range(len(seqs))]
    for r in (fp32, torch_bf16, native):
        r.run([SeqChunk(list(s), 0, len(s), p) for s, p in zip(seqs, pages)])
    next_tokens = [int(torch.randint(3, vocab, (1,), generator=gen)) for _ in seqs]
    err_ref = err_native = 0.0
    agree = rows_seen = 0
    for rows in ([2], [0, 5, 4], list(range(8))):
        for _ in range(4):
            for i in rows:
                seqs[i].append(next_tokens[i])
            want32 = fp32.run(_chunks(seqs, pages, rows)).logits
            want = torch_bf16.run(_chunks(seqs, pages, rows)).logits
            got = native.run(_chunks(seqs, pages, rows)).logits
            assert (got - want).abs().max().item() <= LOGIT_BOUND
            err_ref = max(err_ref, (want - want32).abs().max().item())
            err_native = max(err_native, (got - want32).abs().max().item())
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_BOUND
            same = got.argmax(-1) == want.argmax(-1)
            assert bool(same[clear].all()), "a greedy token differs where the margin exceeds the bound"
            agree += int(same.sum())
            rows_seen += len(rows)
            for i, token in zip(rows, want.argmax(-1).tolist()):
                next_tokens[i] = token
    assert calls == 12  # every decode step ran natively
    assert err_native <= 1.25 * err_ref + 0.01, (err_native, err_ref)
    print(
        f"{kind} K/V {kv_dtype}: greedy agreement {agree}/{rows_seen}; max |logit - fp32| native "
        f"{err_native:.4f}, torch bf16 {err_ref:.4f}"
    )


def test_a_cpu_without_avx512_bf16_falls_back_with_one_log_line(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_step, "bf16_dot_here", lambda: False)
    with caplog.at_level(logging.INFO, logger="radixserve.model"):
        runner = _runner(tiny_llama, torch.bfloat16, False, "bfloat16")
        runner = ModelRunner(runner.model, runner.pool, runner.backend, CPU)
    assert runner.native is None
    lines = [r for r in caplog.records if "native decode step off" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING, [r.getMessage() for r in lines]
    assert "AVX512_BF16" in lines[0].getMessage()
    runner.run([SeqChunk([5, 6, 7], 0, 3, [1])])
    assert runner.run([SeqChunk([5, 6, 7, 8], 3, 1, [1])]).logits.shape[0] == 1  # torch decodes
    fp32 = _runner(tiny_llama, torch.float32, False, "float32")
    assert native_step.unsupported(fp32.model, fp32.pool) is None  # fp32 weights do not need it


def test_the_bf16_env_forces_the_fallback_for_bf16_weights_only(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native_step.BF16_ENV, "0")
    bf16 = _runner(tiny_llama, torch.bfloat16, False, "bfloat16")
    why = native_step.unsupported(bf16.model, bf16.pool)
    assert why is not None and native_step.BF16_ENV in why
    fp32 = _runner(tiny_llama, torch.float32, False, "float32")
    assert native_step.unsupported(fp32.model, fp32.pool) is None


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a",
    "Here is a list of prime numbers: 2, 3, 5,",
    "The three laws of robotics are",
]


@needs_bf16_dot
@pytest.mark.real_model
def test_bf16_native_engine_agrees_with_the_torch_bf16_engine_on_real_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy on the real model (SmolLM2-135M as bf16), 5 prompts x 20 tokens: each sequence follows its
    own tokens, so one flip changes the rest of that sequence; the tokens up to each sequence's first
    difference are counted. Asserted: at least 80% of them overall, the first token of every prompt."""
    from radixserve import Engine, SamplingParams

    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options: dict[str, Any] = {
        "dtype": "bfloat16",
        "page_size": 16,
        "kv_cache_gb": 0.25,
        "enforce_eager": True,
    }
    monkeypatch.setenv(native_step.ENV, "0")
    reference = Engine(prefix_cache=False, **options)
    assert isinstance(reference.runner, ModelRunner) and reference.runner.native is None
    want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, greedy)]
    del reference
    monkeypatch.delenv(native_step.ENV)
    engine = Engine(prefix_cache=False, **options)
    assert isinstance(engine.runner, ModelRunner) and engine.runner.native is not None
    got = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)]
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    print(f"bf16 native vs torch bf16, tokens before the first difference: {prefix} of 20 each")
    assert all(p >= 1 for p in prefix)
    assert sum(prefix) >= 0.8 * 20 * len(PROMPTS)
