"""bf16 arithmetic in the CPU attention's many-row (prefill, extend) items over bf16 pages
(``csrc/gemm_bf16.cpp``) against its own reference: exact attention (the torch reference, fp32) over
the same bf16 K/V with ``q * scale`` rounded to bf16. The kernel also rounds each softmax probability
to bf16 before P V (relative error at most 2^-9, nearest even) while the row sums stay fp32, so each
output lies within 2^-9 * max|v| of that reference; the tests allow 2^-8 * max|v| + 1e-5."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
import torch

from radixserve.kernels import cpu_build, reference
from radixserve.model.attention import get_backend

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)
from radixserve.kernels import cpu  # noqa: E402

MakePaged = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
ops = torch.ops.radixserve_cpu
CPU = torch.device("cpu")
SCALE = 0.125
has_bf16 = bool(ops.gguf_bf16_dot())
needs_bf16 = pytest.mark.skipif(
    not has_bf16, reason="this CPU (or build of the kernels) has no AVX512_BF16: the bf16 path cannot run"
)
# (new tokens, whole length): prefill on and off the 64-row tiles, odd lengths (an odd last pair of P
# and V), extends over cached prefixes, one over a long prefix split across threads, a lone new token.
SEGS = [(37, 37), (100, 600), (5, 37), (1, 70), (64, 77), (3, 1100), (129, 129)]


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, bf16: bool) -> torch.Tensor:
    cu = torch.zeros(len(SEGS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([t for t, _ in SEGS]).cumsum(0)
    lens = torch.tensor([n for _, n in SEGS], dtype=torch.int32)
    plan = cpu.Plan(*ops.plan(table, cu, lens, k.shape[1], 4, 256))
    out, _ = ops.paged_attention(q, k, v, table, *plan.tensors(), SCALE, None, None, bf16)
    return out


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(len(SEGS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([t for t, _ in SEGS]).cumsum(0)
    lens = torch.tensor([n for _, n in SEGS], dtype=torch.int32)
    q_bf16 = (q * SCALE).bfloat16().float()  # the kernel's rounding of q * scale
    return reference.extend_attention(q_bf16, k, v, table, cu, lens, 1.0)


@needs_bf16
@pytest.mark.parametrize("head_dim", [64, 48, 80, 128])
@pytest.mark.parametrize(("group", "kv_heads"), [(1, 3), (3, 3), (4, 2)])
def test_bf16_items_match_their_reference(
    head_dim: int, group: int, kv_heads: int, make_paged: MakePaged
) -> None:
    k, v, table = make_paged([n for _, n in SEGS], 16, kv_heads, head_dim, torch.bfloat16, CPU, seed=head_dim)
    q = torch.randn(
        sum(t for t, _ in SEGS), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1)
    )
    got = _run(q, k, v, table, bf16=True)
    want = _reference(q, k, v, table)
    bound = 2.0**-8 * float(v.float().abs().max()) + 1e-5
    assert float((got - want).abs().max()) <= bound
    # and it is not the fp32 path: that one multiplies the unrounded q and probabilities
    assert not torch.equal(got, _run(q, k, v, table, bf16=False))


@needs_bf16
def test_bf16_is_closer_to_its_reference_than_a_wrong_pairing_would_be(make_paged: MakePaged) -> None:
    """The bound is tight enough to catch a kernel that pairs the wrong values: swapping V's tokens
    within each pair moves the reference far outside it."""
    k, v, table = make_paged([n for _, n in SEGS], 16, 2, 64, torch.bfloat16, CPU, seed=3)
    q = 3 * torch.randn(sum(t for t, _ in SEGS), 8, 64, generator=torch.Generator().manual_seed(2))
    got = _run(q, k, v, table, bf16=True)
    bound = 2.0**-8 * float(v.float().abs().max()) + 1e-5
    assert float((got - _reference(q, k, v, table)).abs().max()) <= bound
    swapped = v.view(v.shape[0], v.shape[1] // 2, 2, *v.shape[2:]).flip(2).reshape(v.shape)
    assert float((got - _reference(q, k, swapped, table)).abs().max()) > 10 * bound


def test_float32_pages_ignore_the_flag(make_paged: MakePaged) -> None:
    k, v, table = make_paged([n for _, n in SEGS], 16, 3, 64, torch.float32, CPU, seed=4)
    q = torch.randn(sum(t for t, _ in SEGS), 9, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_run(q, k, v, table, bf16=True), _run(q, k, v, table, bf16=False))


def test_the_switch_is_decided_when_the_ops_load_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cpu.bf16_attention() is has_bf16  # where the CPU has AVX512_BF16, unless turned off
    backend = get_backend("cpu")
    assert backend.attention_arithmetic("bfloat16") == ("bf16" if has_bf16 else "fp32")
    assert backend.attention_arithmetic("float32") == backend.attention_arithmetic("int8") == "fp32"
    monkeypatch.setattr(cpu, "_vec_size", None)  # as in a fresh process
    monkeypatch.setenv(cpu.BF16_ENV, "0")
    assert cpu.bf16_attention() is False
    assert backend.attention_arithmetic("bfloat16") == "fp32"
    monkeypatch.delenv(cpu.BF16_ENV)
    assert cpu.bf16_attention() is False  # decided once per process
    monkeypatch.setattr(cpu, "_vec_size", None)
    assert cpu.bf16_attention() is has_bf16


def test_the_disk_tier_key_tells_bf16_attention_apart() -> None:
    """Its outputs differ, so the K/V it writes in later layers do: a disk tier must not mix them."""
    from radixserve.cache.tiers import model_fingerprint

    model = torch.nn.Linear(4, 4)
    fp32 = model_fingerprint(model, "config", torch.float32, 16, "bfloat16")
    model.attention_arithmetic = "bf16"  # type: ignore[assignment]
    assert model_fingerprint(model, "config", torch.float32, 16, "bfloat16") != fp32
