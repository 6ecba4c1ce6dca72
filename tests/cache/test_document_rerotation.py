"""Placing a document chunk (issue 57): K computed at positions p and re-rotated to q equals K computed
at q, under every RoPE scaling the loaders take; pages placed in the pool; the selection rule."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from tiny_models import TINY

from radixserve.cache.page_pool import KVPool
from radixserve.model.blend import read_slots, write_slots
from radixserve.model.blend_select import PlacedRun, choose, recompute_count
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.model_config import ModelConfig
from radixserve.model.rerotate import place_slots, rerotate, rerotation_problem

SCALINGS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
}


def _model(scaling: dict[str, Any] | None, theta: float = 500000.0) -> LlamaForCausalLM:
    spec = {**TINY["llama"], "vocab_size": 300, "max_position_embeddings": 16384}
    cfg = ModelConfig.from_dict(
        {**spec, "rope_theta": theta, "rope_scaling": scaling, "num_hidden_layers": 2}
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)  # K of magnitude ~10: the tolerance is absolute
    return model


def _layer0_k(model: LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    layer = cast(DecoderLayer, model.layers[0])
    with torch.no_grad():
        x = layer.input_layernorm(model.embed_tokens(ids))
        _, k, _ = layer.self_attn.qkv(x, model.rotary.table(positions))
    return k


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize(("p", "q"), [(0, 7), (0, 3000), (500, 12000), (9000, 3)])
def test_rerotated_k_equals_k_computed_at_the_new_positions(name: str, p: int, q: int) -> None:
    model = _model(SCALINGS[name])
    assert rerotation_problem(model) is None
    ids = torch.randint(0, 300, (64,))
    src = torch.arange(p, p + 64)
    dst = torch.arange(q, q + 64)
    moved = rerotate(_layer0_k(model, ids, src), model.rotary, src, dst)
    expected = _layer0_k(model, ids, dst)
    assert expected.abs().max() > 1.0
    assert (moved - expected).abs().max().item() <= 1e-5


def test_a_scaling_not_linear_in_position_is_named() -> None:
    model = _model(None)
    model.config = ModelConfig(**{**model.config.__dict__, "rope_scaling": {"rope_type": "dynamic"}})
    problem = rerotation_problem(model)
    assert problem is not None and "dynamic" in problem


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_place_slots_moves_k_and_copies_v(kv_dtype: str) -> None:
    model = _model(SCALINGS["llama3"])
    pool = KVPool(2, 8, 4, 2, 16, kv_dtype)
    ids = torch.randint(0, 300, (10,))
    src_pos, dst_pos = torch.arange(10), torch.arange(37, 47)
    k0 = _layer0_k(model, ids, src_pos)
    v0 = torch.randn(10, 2, 16)
    src_slots = torch.arange(10)  # pages 0-2
    dst_slots = torch.tensor([13, 14, 15, 20, 21, 22, 23, 28, 29, 30])  # pages 3, 5, 7 of another table
    for cache in pool.layers:
        write_slots(cache, src_slots, k0, v0)
    before_k, before_v = read_slots(pool.layers[0], src_slots)
    place_slots(pool, model.rotary, src_slots, dst_slots, src_pos, dst_pos)
    k, v = read_slots(pool.layers[1], dst_slots)
    expected = _layer0_k(model, ids, dst_pos)
    tol = {"float32": 1e-5, "bfloat16": 0.1, "int8": 0.2}[kv_dtype]
    assert (k - expected).abs().max().item() <= tol
    assert torch.equal(v, before_v)
    assert torch.equal(read_slots(pool.layers[0], src_slots)[0], before_k)  # the chunk stays as it was


def test_choose_takes_sinks_then_the_most_deviating() -> None:
    deviation = torch.zeros(60)
    deviation[[30, 41, 55]] = torch.tensor([3.0, 5.0, 4.0])
    deviation[45] = 2.0
    forced = torch.zeros(60, dtype=torch.bool)
    forced[25] = True  # a separator between the two runs: always computed
    runs = [PlacedRun(0, 25, 4), PlacedRun(26, 60, 0)]  # the second's chunk start is in the exact prefix
    assert recompute_count(runs[0], 0.2) == 5 and recompute_count(runs[1], 0.1) == 4
    keep = choose(deviation, forced, runs, 0.2)
    # run 0: 5 = 4 sinks + one more of rows 4..24 (all tie at zero)
    # run 1: ceil(0.2 * 34) = 7 rows, no sinks, the 4 planted first
    picked = set(keep.nonzero().squeeze(1).tolist())
    assert {0, 1, 2, 3, 25, 30, 41, 45, 55} <= picked
    assert len(picked) == 5 + 1 + 7
    assert choose(deviation, forced, runs, 0.0).nonzero().squeeze(1).tolist() == [25]
    assert choose(deviation, forced, runs, 1.0).all()
