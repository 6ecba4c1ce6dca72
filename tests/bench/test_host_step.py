"""The host-step benchmark's stub forward (benchmarks/step/host_step.py) on the tiny model: steps make
the stub's token without any layer running, and the stubbed offline timing runs end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.step import host_step
from radixserve import Engine, SamplingParams
from radixserve.model.runner import ModelRunner

TOKEN = 7


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelRunner, "run", ModelRunner.run)  # restored after the test
    host_step.stub_forward(ModelRunner, TOKEN)


def test_stubbed_steps_make_the_token_and_run_no_layer(tiny_llama: Path, stubbed: None) -> None:
    engine = Engine(str(tiny_llama), num_pages=64, enforce_eager=True)
    assert TOKEN not in engine.eos
    layers = []
    for module in engine.model.modules():
        module.register_forward_pre_hook(lambda m, _: layers.append(m))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = engine.generate(["one prompt", "another prompt"], params)
    assert [o.outputs[0].token_ids for o in outs] == [[TOKEN] * 6] * 2
    assert layers == [] and engine.num_steps >= 6
    engine.close()


def test_the_offline_timing_runs_stubbed(tiny_llama: Path, stubbed: None) -> None:
    result = host_step.offline(str(tiny_llama), [1, 3], steps=3, stub=TOKEN, threads=1)
    assert Path(result["radixserve"]).name == "__init__.py"
    for batch in (1, 3):
        row = result[str(batch)]
        assert row["model_calls"] == 0 and row["step_ms"] > 0 and row["loop_step_ms"] > 0
