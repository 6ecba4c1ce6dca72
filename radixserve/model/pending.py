"""The tokens the previous step sampled that the host has not read yet (the overlapped loop,
``engine/overlap.py``): how a step's input ids take them on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A token sampled by the previous step that the host has not read yet (the overlapped loop,
# engine/overlap.py): it stands last in its request's ``token_ids`` and never reaches the model, which
# takes the token from ``Pending`` on the device instead.
PENDING = -1


@dataclass(slots=True)
class Pending:
    """The previous step's sampled tokens, still on the device, and the chunks whose last new token is
    one of them: chunk ``chunks[i]`` ends at ``tokens[rows[i]]``."""

    tokens: torch.Tensor  # [rows] int64, on the model's device
    chunks: list[int]
    rows: list[int]

    def fill(self, ids: torch.Tensor, at: list[int]) -> None:
        """Write the pending tokens into ``ids`` (a step's input ids) at positions ``at``, one for each
        of ``chunks``, on the device: nothing is read back to the host."""
        dev = ids.device
        where = torch.tensor(at, dtype=torch.int64).to(dev, non_blocking=True)
        rows = torch.tensor(self.rows, dtype=torch.int64).to(dev, non_blocking=True)
        ids.index_copy_(0, where, self.tokens.index_select(0, rows).to(ids.dtype))
