"""Building the lower tiers a config asks for (``make_tiers``): the host store, then the disk store,
under one ``TierController``, keyed by the model's fingerprint; and the disk tier's default size.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from radixserve.cache.disk_store import DiskStore
from radixserve.cache.page_pool import PageCopier, PagedPool
from radixserve.cache.tier_controller import TierController, WritePolicy
from radixserve.cache.tiers import HostStore, KVStore, model_fingerprint

logger = logging.getLogger(__name__)

# The disk tier's size when only its directory is given: a tenth of the free space on that
# filesystem, so a cache never fills a disk by default, and at most 64 GiB, past which a prefix cache
# of one model rarely gets hits that pay for the space.
DISK_DEFAULT_FRACTION = 0.10
DISK_DEFAULT_MAX_BYTES = 64 * 2**30


def default_disk_bytes(directory: str | Path) -> int:
    """The disk tier's size when only its directory is given (``DISK_DEFAULT_FRACTION`` of the free
    space on its filesystem, at most ``DISK_DEFAULT_MAX_BYTES``)."""
    path = Path(directory).absolute()
    while not path.exists():  # made later by DiskStore: measure the filesystem it will be on
        path = path.parent
    return min(int(shutil.disk_usage(path).free * DISK_DEFAULT_FRACTION), DISK_DEFAULT_MAX_BYTES)


def make_tiers(
    pool: PagedPool,
    backend: PageCopier,
    model: torch.nn.Module,
    model_config: object,
    *,
    model_dtype: torch.dtype,
    host_bytes: int,
    disk_bytes: int,
    disk_dir: str | None,
    write_policy: str,
    write_through_threshold: int,
) -> TierController | None:
    """The stores a config asks for beneath ``pool`` (host, then disk), or None when it asks for none.

    A disk directory without a size gets ``default_disk_bytes`` of it.
    """
    if disk_dir and disk_bytes <= 0:
        disk_bytes = default_disk_bytes(disk_dir)
        logger.info(
            "disk KV cache in %s: %.1f GiB (the default share of its free space)",
            disk_dir,
            disk_bytes / 2**30,
        )
    if host_bytes <= 0 and disk_bytes <= 0:
        return None
    # A page travels as the pool's byte record (K, V and any scales); the fingerprint keys it by
    # model, weights format, page size and KV dtype, so no page is read back at another dtype.
    page_shape = (pool.page_bytes,)
    fingerprint = model_fingerprint(
        model, model_config, model_dtype, pool.page_size, pool.kv_dtype, shards=pool.shards
    )
    stores: list[KVStore] = []
    if host_bytes > 0:
        stores.append(HostStore(host_bytes, page_shape, torch.uint8, pin=pool.k_buffer.is_cuda))
    if disk_bytes > 0:
        if not disk_dir:
            raise ValueError("a disk tier needs disk_cache_dir")
        stores.append(DiskStore(disk_dir, disk_bytes, fingerprint, page_shape, torch.uint8))
    policy = WritePolicy(write_policy)
    return TierController(
        stores, fingerprint, pool, backend, policy, write_through_threshold, scatter_on_land=pool.shards > 1
    )
