"""The KV transfer record: a header, then ``num_pages`` page byte records (``KVPool.read_pages``).

Invariants:
- A record is written into a decode engine's pool only if its layout fingerprint equals the decode
  engine's (model, weights dtype and quantization, page size, KV dtype: ``cache/tiers.model_fingerprint``)
  and its CRC32 matches; otherwise ``KVTransferError`` says which, and nothing is written.
- Pages are addressed by their index in the request's page table (``first_page``), so a chunk sent
  twice (a prefill retried on another engine) lands where it did the first time.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import msgspec
import torch

from radixserve.cache.tiers import model_fingerprint

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine


class KVTransferError(RuntimeError):
    """A transfer that cannot be used: another layout, a bad checksum, a wrong size, or a timeout."""


class TransferHeader(msgspec.Struct, array_like=True, kw_only=True):
    """One chunk of a request's pages, as the prefill engine sent it."""

    request_id: str
    first_page: int  # index in the request's page table of the first page in this chunk
    num_pages: int
    page_bytes: int
    fingerprint: bytes
    checksum: int  # CRC32 of the records
    sent_at: float  # time.time() when the prefill side read the pages (for the latency histogram)
    shm_path: str | None = None  # the shared-memory transport's file; None: the records follow the header


def layout_fingerprint(engine: Engine) -> bytes:
    """The fingerprint the tiers key pages by, for this engine's model and pool."""
    pool = engine.pool
    return model_fingerprint(engine.model, engine.model.config, engine.dtype, pool.page_size, pool.kv_dtype)


def checksum(records: torch.Tensor) -> int:
    return zlib.crc32(records.contiguous().numpy().data)


def verify(header: TransferHeader, records: torch.Tensor, fingerprint: bytes, page_bytes: int) -> None:
    """Raise ``KVTransferError`` unless ``records`` can be written into a pool of this layout."""
    if header.fingerprint != fingerprint:
        raise KVTransferError(
            f"KV transfer for request {header.request_id!r} refused: the prefill engine's layout fingerprint "
            f"{header.fingerprint.hex()} is not this decode engine's {fingerprint.hex()} (another model, "
            "weights dtype or quantization, page size or KV dtype)"
        )
    want = (header.num_pages, page_bytes)
    if header.page_bytes != page_bytes or tuple(records.shape) != want or records.dtype != torch.uint8:
        raise KVTransferError(
            f"KV transfer for request {header.request_id!r} refused: {tuple(records.shape)} records of "
            f"{header.page_bytes} bytes, want {want}"
        )
    got = checksum(records)
    if got != header.checksum:
        raise KVTransferError(
            f"KV transfer for request {header.request_id!r} refused: checksum {got:#010x} != "
            f"{header.checksum:#010x} sent"
        )
