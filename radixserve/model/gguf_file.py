"""Reading a GGUF file: its header and metadata parsed (``gguf.GGUFReader``, over a plain array
view of the file's pages), every tensor checked to lie whole inside the file, and a tensor copied out
as a ``Weight`` on demand. ``model/gguf_load.py`` builds a model from what this reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.model.gguf import SUPPORTED, Weight
from radixserve.model.gguf_blocks import FORMATS, TYPE_NAMES, is_blocks, row_bytes


@dataclass
class GGUFFile:
    """A checked GGUF file: its metadata (big arrays left out) and its tensors, still in the file."""

    path: Path
    reader: Any  # gguf.GGUFReader
    meta: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    def weight(self, name: str) -> Weight:
        """The tensor ``name`` copied once out of the file, in torch's dimension order."""
        t = self.tensors[name]
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dimensions fastest first
        qtype = int(t.tensor_type)
        array = np.ascontiguousarray(t.data)
        data = torch.from_numpy(array.copy())
        if is_blocks(qtype):
            data = data.reshape(-1, row_bytes(qtype, shape[-1]))
        else:
            data = data.reshape(shape)
        return Weight(qtype, data, shape[-1])


@functools.cache
def _reader_class() -> Any:
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """GGUFReader over the file's pages as a plain array, not a ``np.memmap``: the reader parses every
        metadata value through small slices (the tokenizer's ~100k strings, each a few), and each slice
        of a memmap runs memmap's Python hooks, which were most of the read (7.5 s of the default model's
        file; 3 s without). The array is a view of the memmap, which stays open beneath it."""

        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)

    return Reader


def gguf_reader(path: Path | str) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (fields, tensors and their data as the reader gives them)."""
    return _reader_class()(path)


def read_gguf(path: Path) -> GGUFFile:
    """Open and check ``path``: a readable header, supported tensor types, and every tensor's bytes
    inside the file. Raises ``ValueError`` naming the problem; reads no tensor data."""
    size = path.stat().st_size
    try:
        reader = gguf_reader(path)
    except Exception as exc:  # the reader raises what numpy and struct raise on bad bytes
        raise ValueError(
            f"{path} is not a readable GGUF file: it is truncated or corrupted ({type(exc).__name__}: {exc})"
        ) from exc
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if qtype not in TYPE_NAMES:
            raise ValueError(
                f"GGUF tensor {t.name} in {path} has type {t.tensor_type.name}, which radixserve does not "
                f"support; supported types: {SUPPORTED} (llama-quantize --allow-requantize converts a "
                "file to one of them)"
            )
        cols = int(t.shape[0])
        count = int(np.prod([int(d) for d in t.shape]))
        if is_blocks(qtype) and cols % FORMATS[qtype].weights:
            raise ValueError(
                f"GGUF tensor {t.name} in {path}: {cols} columns are not whole {t.tensor_type.name} "
                f"blocks of {FORMATS[qtype].weights} weights"
            )
        need = count // cols * row_bytes(qtype, cols)
        start = int(t.data_offset)
        if int(t.n_bytes) != need or start + need > size:
            raise ValueError(
                f"GGUF file {path} is truncated or corrupted: tensor {t.name} ({t.tensor_type.name}, shape "
                f"{[int(d) for d in t.shape]}) needs bytes [{start}, {start + need}) but the file has {size}"
            )
        tensors[t.name] = t
    from radixserve.model.default_model import _read_metadata

    return GGUFFile(path, reader, _read_metadata(reader), tensors)
