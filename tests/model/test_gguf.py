"""GGUF-native weights (model/gguf.py, model/gguf_load.py): block decoding against gguf's reference,
tiny GGUF models against the fp32 folder of their exact dequantization, the tokenizer and chat template
from the metadata, and clear errors for unsupported types and damaged files."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as reference_dequantize
from gguf_files import BLOCK_TYPES, random_blocks, write_fp32_folder, write_tiny_gguf
from server_util import running_server

from radixserve import Engine, SamplingParams
from radixserve.cache.tiers import model_fingerprint
from radixserve.config import EngineConfig
from radixserve.model import gguf, gguf_blocks, gguf_load
from radixserve.model.gguf import GGUFEmbedding, GGUFLinear
from radixserve.model.gguf_file import read_gguf
from radixserve.model.llama import DecoderLayer
from radixserve.model.loader import load_model

Q = GGMLQuantizationType
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7], [100, 3], [250, 251, 252, 9, 11, 13], [64]]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF tokenizer folders under ``tmp_path``, not the user's cache (which also holds the built C++
    kernels, so XDG_CACHE_HOME is left alone)."""
    monkeypatch.setattr(gguf_load, "models_cache", lambda: tmp_path / "cache")


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_block_decoding_equals_the_reference_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    blocks = random_blocks(qtype, rows=37, blocks=5)
    want = reference_dequantize(blocks.numpy(), qtype).reshape(37, -1)
    assert want.shape[1] == 5 * gguf_blocks.FORMATS[int(qtype)].weights
    got = gguf.dequantize(blocks, int(qtype)).numpy()
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q(q) for q in gguf_blocks.CHUNK_AFFINE])
def test_the_integer_form_of_blocks_is_the_reference_bit_for_bit(qtype: GGMLQuantizationType) -> None:
    """``chunk_integers`` (what the int8 kernel multiplies): scale * value + minimum, per chunk of 32."""
    blocks = random_blocks(qtype, rows=37, blocks=5)
    values, scale, minimum = gguf_blocks.chunk_integers(blocks, int(qtype))
    assert values.dtype == torch.int32 and values.shape == (37, scale.shape[1], 32)
    got = gguf_blocks.affine_weights(values, scale, minimum).numpy()
    want = reference_dequantize(blocks.numpy(), qtype).reshape(37, -1)
    # Bit for bit, but for a zero's sign: Q3_K and Q6_K fold their 16-weight scales into the integers.
    assert np.array_equal(got, want) and bool(
        ((got.view(np.uint32) == want.view(np.uint32)) | (want == 0)).all()
    )


@pytest.mark.parametrize(
    ("decoder", "embedding", "head"),
    [
        (Q.Q4_0, Q.Q8_0, None),
        (Q.Q4_1, Q.Q4_1, Q.Q8_0),
        (Q.Q8_0, Q.F16, Q.F32),
        (Q.Q5_0, Q.Q5_1, Q.Q5_0),
        (Q.Q5_1, Q.Q5_0, None),
    ],
)
def test_gguf_model_is_token_identical_to_its_fp32_dequantization(
    tmp_path: Path, decoder: Q, embedding: Q, head: Q | None
) -> None:
    file = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(file, decoder, embedding, head)
    folder = write_fp32_folder(tmp_path / "fp32", weights)
    options = {"enforce_eager": True, "num_pages": 64, "page_size": 4}
    fp32 = Engine(model=str(folder), **options)
    native = Engine(model=str(file), **options)
    assert native.config.quantization == "gguf" and native.model.quantization == "gguf"
    layer = native.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear) and isinstance(layer.mlp.down_proj, GGUFLinear)
    assert isinstance(native.model.embed_tokens, GGUFEmbedding)
    if head is None:  # tied: the head multiplies the embedding's own blocks
        assert native.model.lm_head.weight0.data_ptr() == native.model.embed_tokens.weight.data_ptr()
    # The embedding and the head agree to rounding ...
    ids = torch.tensor(PROMPTS[2])
    assert torch.equal(native.model.embed_tokens(ids), fp32.model.embed_tokens(ids))
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(
        native.model.compute_logits(hidden), fp32.model.compute_logits(hidden), rtol=1e-4, atol=1e-5
    )
    # ... and greedy decoding (every layer: the q/k row order, each block type) gives the same tokens.
    a = [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, GREEDY)]
    b = [o.outputs[0].token_ids for o in native.generate(PROMPTS, GREEDY)]
    assert a == b


def test_gguf_tokenizer_and_chat_template_come_from_the_metadata(tmp_path: Path) -> None:
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    engine = Engine(model=str(file), enforce_eager=True, num_pages=64, page_size=4)
    ids = engine.apply_chat_template([{"role": "user", "content": "hello"}])
    assert engine.tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert engine.tokenizer.eos_token == "<|endoftext|>"
    (folder,) = [p for p in (tmp_path / "cache").glob("tiny-gguf-tokenizer-*") if p.is_dir()]
    marker = (folder / gguf_load.TOKENIZER_MARKER).stat().st_mtime_ns
    assert gguf_load.tokenizer_dir(file) == folder  # reused, not rebuilt
    assert (folder / gguf_load.TOKENIZER_MARKER).stat().st_mtime_ns == marker


def test_gguf_changes_the_disk_tier_fingerprint(tmp_path: Path) -> None:
    weights = write_tiny_gguf(tmp_path / "a.gguf", Q.Q4_0)
    write_tiny_gguf(tmp_path / "b.gguf", Q.Q4_1)
    folder = write_fp32_folder(tmp_path / "fp32", weights)
    models = [load_model(p, torch.float32, CPU) for p in (tmp_path / "a.gguf", tmp_path / "b.gguf", folder)]
    prints = {model_fingerprint(m, m.config, torch.float32, 4) for m in models}
    assert len(prints) == 3


def test_quantization_gguf_options_are_checked(tmp_path: Path) -> None:
    assert EngineConfig(model="x.gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="does not apply to the GGUF file"):
        EngineConfig(model="x.gguf", quantization="int8")
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        EngineConfig(model=str(tmp_path), quantization="gguf")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="q4")
    with pytest.raises(ValueError, match="runs on CPU in float32"):
        gguf_load.check_supported(torch.bfloat16, CPU)


def test_unsupported_tensor_type_is_refused_naming_it(tmp_path: Path) -> None:
    file = tmp_path / "tq1.gguf"
    writer = GGUFWriter(str(file), "llama")
    from gguf.quants import quantize

    data = quantize(np.ones((4, 256), np.float32), Q.TQ1_0)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_dtype=Q.TQ1_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match=r"blk\.0\.attn_q\.weight .* type TQ1_0.*supported types: .*Q4_0.*Q5_0.*Q4_K.*Q6_K"
    ):
        read_gguf(file)


def test_truncated_file_is_refused_before_loading(tmp_path: Path) -> None:
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_model(file, torch.float32, CPU)
    file.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(ValueError, match="not a readable GGUF file: it is truncated or corrupted"):
        load_model(file, torch.float32, CPU)


def test_corrupted_header_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    data = bytearray(file.read_bytes())
    data[:4] = b"XXXX"  # the magic
    file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a readable GGUF file: it is truncated or corrupted"):
        load_model(file, torch.float32, CPU)


def test_a_gguf_file_is_served_with_its_chat_template(tmp_path: Path) -> None:
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    config = EngineConfig(model=str(file), enforce_eager=True, num_pages=64, page_size=4)
    with running_server(config, model_name="tiny") as url:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, trust_env=False)
        assert resp.status_code == 200, resp.text
        # The prompt rendered through the GGUF's ChatML template: 3 special tokens, 'user', 'hello'...
        engine = Engine(model=str(file), enforce_eager=True, num_pages=64, page_size=4)
        want = len(engine.apply_chat_template(body["messages"]))  # type: ignore[arg-type]
        assert resp.json()["usage"]["prompt_tokens"] == want
        assert resp.json()["usage"]["completion_tokens"] == 4
