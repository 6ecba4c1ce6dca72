"""Our model over the paged pool against HF transformers (the reference), on tiny random configs, with
the torch reference attention and with the default CPU backend (the C++ kernels where they build)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve.cache.page_pool import KVPool
from radixserve.model.attention import select_backend
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk

KINDS = ["llama", "llama-tied", "qwen2", "qwen3"]


@pytest.fixture(params=["torch", "auto"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _runner(path: Path, page_size: int, backend: str, num_pages: int = 512) -> ModelRunner:
    model = load_model(path, torch.float32, torch.device("cpu"))
    c = model.config
    pool = KVPool(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, torch.float32)
    return ModelRunner(model, pool, select_backend(backend, torch.device("cpu")), torch.device("cpu"))


def _hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _pages(n_tokens: int, page_size: int, start: int) -> list[int]:
    # Deliberately scattered page indices: the page table, not adjacency, must carry the order.
    return [start + 2 * i for i in range(-(-n_tokens // page_size))]


@pytest.mark.parametrize("kind", [*KINDS, "mistral"])
def test_prefill_logits_match_hf(tiny_models: dict[str, Path], kind: str, backend: str) -> None:
    path = tiny_models[kind]
    runner, hf = _runner(path, 4, backend), _hf(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 290, (n,), generator=gen).tolist() for n in (7, 19, 1, 33)]
    chunks = [
        SeqChunk(p, 0, len(p), _pages(len(p), 4, 1 + 60 * i), want_all_logits=True)
        for i, p in enumerate(prompts)
    ]
    out = runner.run(chunks)  # all four ragged prompts in one forward
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(
            out.all_logits[i] if len(p) > 1 else out.logits[i : i + 1], ref, atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(out.logits[i], ref[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_logits_match_hf_cache(
    tiny_models: dict[str, Path], kind: str, page_size: int, backend: str
) -> None:
    path = tiny_models[kind]
    runner, hf = _runner(path, page_size, backend), _hf(path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 290, (n,), generator=gen).tolist() for n in (5, 12, 30)]
    steps = 10
    pages = [_pages(len(p) + steps, page_size, 1 + 100 * i) for i, p in enumerate(prompts)]
    runner.run([SeqChunk(p, 0, len(p), pages[i]) for i, p in enumerate(prompts)])
    hf_past = []
    for p in prompts:
        with torch.no_grad():
            o = hf(torch.tensor([p]), use_cache=True)
        hf_past.append(o.past_key_values)
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        new = [int(torch.randint(0, 290, (1,), generator=gen)) for _ in seqs]
        for s, t in zip(seqs, new):
            s.append(t)
        out = runner.run([SeqChunk(s, len(s) - 1, 1, pages[i]) for i, s in enumerate(seqs)])
        for i, t in enumerate(new):
            with torch.no_grad():
                o = hf(torch.tensor([[t]]), past_key_values=hf_past[i], use_cache=True)
            hf_past[i] = o.past_key_values
            torch.testing.assert_close(out.logits[i], o.logits[0, -1], atol=1e-4, rtol=1e-4)


def test_mixed_extend_and_decode_in_one_step(tiny_llama: Path, backend: str) -> None:
    """A prefill chunk over a cached prefix and decode tokens flattened into one forward."""
    runner, hf = _runner(tiny_llama, 4, backend), _hf(tiny_llama)
    a = list(range(3, 40))
    b = list(range(50, 61))
    pa, pb = _pages(len(a), 4, 1), _pages(len(b) + 1, 4, 100)
    runner.run([SeqChunk(a, 0, 20, pa), SeqChunk(b, 0, len(b), pb)])  # a: first chunk only
    b2 = b + [7]
    out = runner.run([SeqChunk(b2, len(b), 1, pb), SeqChunk(a, 20, len(a) - 20, pa)])
    with torch.no_grad():
        ref_a = hf(torch.tensor([a])).logits[0, -1]
        ref_b = hf(torch.tensor([b2])).logits[0, -1]
    torch.testing.assert_close(out.logits[1], ref_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[0], ref_b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("style", ["rope_scaling", "rope_parameters"])
def test_linear_rope_scaling_matches_hf(tiny_llama: Path, tmp_path: Path, style: str) -> None:
    """Linear RoPE scaling (positions divided by ``factor``), written the legacy way
    (``rope_scaling: {"type": "linear"}``) or the transformers-5 way (``rope_parameters``)."""
    path = tmp_path / "tiny-llama-linear"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    if style == "rope_scaling":
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    else:
        cfg["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    prompt = list(range(3, 70))
    out = _runner(path, 4, "torch").run([SeqChunk(prompt, 0, len(prompt), _pages(len(prompt), 4, 1), True)])
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([prompt])).logits[0]
        unscaled = _hf(tiny_llama)(torch.tensor([prompt])).logits[0]
    assert (ref - unscaled).abs().max() > 0.1  # the scaling is live: a model ignoring it would fail below
    torch.testing.assert_close(out.all_logits[0], ref, atol=1e-4, rtol=1e-4)


def test_prepacked_linears_match_the_plain_product() -> None:
    """On CPU, Linear multiplies 3+ rows through a oneDNN-blocked weight copy (layers.Linear); it
    must agree with the plain product at every row count, and one or two rows keep the plain path."""
    from radixserve.model.layers import Linear

    torch.manual_seed(0)
    lin = Linear(96, 200, bias=True)
    xs = [torch.randn(m, 96) for m in (1, 2, 3, 8, 33, 600)]
    plain = [lin(x) for x in xs]
    lin.prepack()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert lin.packed is not None
    for x, want in zip(xs, plain):
        torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=1e-5)
