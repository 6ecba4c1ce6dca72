"""The 1B benchmark model's builder (benchmarks/step/big_model.py), run on a SMALL shape through the same
code: the folder it writes is an HF Llama folder the engine serves, its GGUF form holds the same
weights (q/k rows in llama.cpp's order and back), and a second build reuses the cached folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from benchmarks.lib import bench_models as big_model
from benchmarks.lib.bench_models import LLAMA_1B, Shape
from radixserve import Engine, SamplingParams

SMALL = Shape("small-test", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return big_model.build(SMALL, seed=3, root=tmp_path_factory.mktemp("bench-models"))


def test_the_1b_shape_is_llama_3_2_1b() -> None:
    cfg = big_model.hf_config(LLAMA_1B)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (16, 2048, 8192)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 8, 64)
    assert 1.07e9 < LLAMA_1B.parameters() < 1.08e9


def test_the_folder_is_complete_and_sized_as_its_shape(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["hidden_size"] == SMALL.hidden and cfg["num_hidden_layers"] == SMALL.layers
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    count = 0
    for file in set(index.values()):
        with safe_open(str(folder / file), framework="pt") as f:
            count += sum(_numel(f, k) for k in f.keys())  # noqa: SIM118 (safe_open is no mapping)
    assert count == SMALL.parameters()
    assert (folder / "tokenizer.json").is_file() and (folder / big_model.MARKER).is_file()


def _numel(f: object, key: str) -> int:
    return int(np.prod(f.get_slice(key).get_shape()))  # type: ignore[attr-defined]


def test_a_second_build_reuses_the_folder(folder: Path) -> None:
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert big_model.build(SMALL, seed=3, root=folder.parent) == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp


def test_the_engine_serves_the_folder_and_its_gguf_form(folder: Path) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)
    prompt = "The old lighthouse keeper climbed the stairs"
    # Eager steps: what is served is the question, and each engine would compile its step first.
    ref = Engine(model=str(folder), prefix_cache=False, enforce_eager=True).generate([prompt], params)[0]
    assert len(ref.token_ids) == 4
    gguf = big_model.build_gguf(folder, "Q8_0")
    out = Engine(model=str(gguf), prefix_cache=False, enforce_eager=True).generate([prompt], params)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids
    # Q8_0 rounds each weight by at most half a step of amax/127 per block: logprobs stay close.
    ref_lp = [lp.logprob for lp in (ref.prompt_logprobs or [])[1:] if lp is not None]
    out_lp = [lp.logprob for lp in (out.prompt_logprobs or [])[1:] if lp is not None]
    assert len(ref_lp) == len(out_lp) > 0
    assert max(abs(a - b) for a, b in zip(ref_lp, out_lp)) < 0.05


def test_the_gguf_form_holds_the_folder_weights_in_llama_cpp_order(folder: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from radixserve.model.default_model import _unpermute_rotary_rows

    gguf = big_model.build_gguf(folder, "Q8_0")
    reader = GGUFReader(gguf)
    stored = {t.name: t for t in reader.tensors}
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_proj.weight"
    with safe_open(str(folder / index[name]), framework="pt") as f:
        want = f.get_tensor(name)
    t = stored[big_model.gguf_name(name)]
    got = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(want.shape)
    back = torch.from_numpy(_unpermute_rotary_rows(got, SMALL.heads))
    step = want.abs().max() / 127
    assert torch.allclose(back, want, atol=float(step))  # back in HF order, within Q8_0's rounding
    assert not torch.allclose(torch.from_numpy(got), want, atol=float(step))  # stored permuted
