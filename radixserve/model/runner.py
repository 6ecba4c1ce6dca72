"""ModelRunner: turns one scheduled batch into tensors, runs one forward, returns the logits it needs.

The batch is flattened with the extend sequences (prefill chunks of two or more tokens) first and the
single-token sequences last, so attention can hand each part to its own kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from radixserve.cache.page_pool import KVPool
from radixserve.model.attention import AttentionMetadata
from radixserve.model.llama import LlamaForCausalLM


@dataclass(slots=True)
class SeqChunk:
    """What the runner needs of one sequence: its tokens, how many are computed, and its pages."""

    token_ids: list[int]
    num_computed: int
    num_new: int
    page_table: list[int]
    want_all_logits: bool = False  # prompt logprobs need every position's logits


@dataclass(slots=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_chunks, vocab]: the logits after each chunk's last token
    all_logits: dict[int, torch.Tensor]  # chunk index -> [num_new, vocab] where want_all_logits


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, kv: KVPool, backend: ModuleType, device: torch.device
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.page_size = kv.page_size

    def run(self, chunks: list[SeqChunk]) -> RunnerOutput:
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_new == 1)
        ordered = [chunks[i] for i in order]
        input_ids, positions, meta = self._prepare(ordered)
        hidden = self.model(input_ids, positions, meta, self.kv, self.backend)
        ends = torch.tensor([c.num_new for c in ordered], device=self.device).cumsum(0) - 1
        last = self.model.compute_logits(hidden[ends])
        logits = torch.empty_like(last)
        logits[torch.tensor(order, device=self.device)] = last
        all_logits: dict[int, torch.Tensor] = {}
        for pos, i in enumerate(order):
            if chunks[i].want_all_logits:
                end = int(ends[pos]) + 1
                all_logits[i] = self.model.compute_logits(hidden[end - chunks[i].num_new : end])
        return RunnerOutput(logits, all_logits)

    def _prepare(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev, ps = self.device, self.page_size
        flat: list[int] = []
        for c in chunks:
            flat.extend(c.token_ids[c.num_computed : c.num_computed + c.num_new])
        starts = torch.tensor([c.num_computed for c in chunks], dtype=torch.int64)
        lens = torch.tensor([c.num_new for c in chunks], dtype=torch.int64)
        seq_lens = (starts + lens).to(torch.int32)
        # positions: for each token, its sequence's start plus its offset in the chunk (vectorised).
        row = torch.repeat_interleave(torch.arange(len(chunks)), lens)
        cu = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        cu[1:] = lens.cumsum(0)
        positions = starts[row] + torch.arange(len(flat)) - cu[:-1][row]
        width = max(len(c.page_table) for c in chunks)
        table = torch.zeros(len(chunks), width, dtype=torch.int64)
        for i, c in enumerate(chunks):
            table[i, : len(c.page_table)] = torch.tensor(c.page_table, dtype=torch.int64)
        slots = table[row, positions // ps] * ps + positions % ps
        num_ext = sum(1 for c in chunks if c.num_new > 1)
        n_ext_tokens = int(cu[num_ext])
        table32 = table.to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            num_extend_tokens=n_ext_tokens,
            extend_page_table=table32[:num_ext].to(dev),
            extend_cu_q_lens=cu[: num_ext + 1].to(torch.int32).to(dev),
            extend_seq_lens=seq_lens[:num_ext].to(dev),
            decode_page_table=table32[num_ext:].to(dev),
            decode_seq_lens=seq_lens[num_ext:].to(dev),
        )
        if num_ext:
            meta.extend_plan = self.backend.plan_extend(
                meta.extend_page_table, meta.extend_cu_q_lens, meta.extend_seq_lens, ps
            )
        if num_ext < len(chunks):
            meta.decode_plan = self.backend.plan_decode(meta.decode_page_table, meta.decode_seq_lens, ps)
        return torch.tensor(flat, dtype=torch.int64, device=dev), positions.to(dev), meta
