"""ModelRunner: turns one scheduled batch into tensors, runs one forward, returns the logits it needs.

The batch is flattened with the extend sequences (prefill chunks of two or more tokens) first and the
single-token sequences last. The backend plans the step's attention once (``plan_step``); every layer
reuses the plan. Where the step can be captured (``model/compiled.py``), the decoder layers run as
compiled code. A decode-only step of 1-8 rows runs instead as one native call (``model/native_step.py``)
where the model's formats allow it, chosen once here; on CUDA with the Triton backend, a decode-only
step runs as the graph-safe step (``model/graph_step.py``), replaying its CUDA graph
(``model/cuda_graphs.py``) unless ``cuda_graphs`` is off; every other step (prefill, extend, mixed)
runs the torch model.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch

from radixserve.cache.page_pool import KVPool
from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.compiled import CompiledLayers
from radixserve.model.cuda_graphs import capture
from radixserve.model.graph_step import GraphStep
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.native_step import NativeStep, covers
from radixserve.model.pending import Pending

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqChunk:
    """What the runner needs of one sequence: its tokens, how many are computed, and its pages."""

    token_ids: list[int]
    num_computed: int
    num_new: int
    page_table: list[int]
    want_all_logits: bool = False  # prompt logprobs need every position's logits
    logits_from: int = 0  # with want_all_logits: the first position whose logits are wanted


@dataclass(slots=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_chunks, vocab]: the logits after each chunk's last token
    # chunk index -> [rows, vocab] where want_all_logits: the positions from logits_from to the chunk's end
    all_logits: dict[int, torch.Tensor]


@dataclass(slots=True)
class StepInputs:
    """One step as tensors: what the model (compiled or not) takes."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    last_rows: torch.Tensor  # [num_chunks] int64: each chunk's last token
    spans: list[tuple[int, int]]  # each chunk's rows


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        compile_step: bool = False,
        native_step: bool = True,
        cuda_graphs: bool = False,
        max_batch: int = 64,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = device
        self.page_size = pool.page_size
        self.compiled = CompiledLayers.create(model.layers) if compile_step else None
        # The native decode step, chosen once (None: every step runs the torch model; logged why).
        self.native = NativeStep.create(model, pool) if native_step and device.type == "cpu" else None
        # The graph-safe decode step, on CUDA with Triton's kernels (which never read back to the host);
        # its graphs are captured in warmup().
        self.graph_step: GraphStep | None = None
        if cuda_graphs and device.type == "cuda" and backend.name == "triton":
            context = model.config.max_position_embeddings
            self.graph_step = GraphStep(model, pool, backend, max_batch, context)
        self.warmup_s = 0.0  # how long warmup() took
        # The thread that built the runner. On CPU, model code run from any other thread starts a
        # second OpenMP team; with more libgomp threads than cores, libgomp cuts every team's
        # spin-wait to ~100 spins, so each of a step's ~1,000 parallel regions ends in a futex
        # sleep and wake: measured ~40% slower per decode step on 2 cores. Warned about once.
        self._thread = threading.get_ident()
        self._warned_thread = device.type != "cpu"

    def forward(
        self, inputs: StepInputs, want_all: list[int | None]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The logits after each chunk's last token, and for each chunk whose ``want_all`` entry is a
        number those of its positions from that many rows in."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.pool, self.backend)
        spans = [
            (i, start + skip, end)
            for i, (skip, (start, end)) in enumerate(zip(want_all, inputs.spans))
            if skip is not None
        ]
        if not spans:
            return self.model.compute_logits(hidden.index_select(0, inputs.last_rows)), {}
        # One product with the LM head for every row wanted (verifying drafts wants a few per request).
        rows = torch.cat([torch.arange(s, e, device=hidden.device) for _, s, e in spans] + [inputs.last_rows])
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        all_logits, offset = {}, 0
        for i, start, end in spans:
            all_logits[i] = logits[offset : offset + end - start]
            offset += end - start
        return logits[offset:], all_logits

    def warmup(self) -> None:
        """Compile before serving: a two-token and a one-token step (the graphs every step uses)
        over page 0, which holds nothing yet."""
        start = time.perf_counter()
        if self.compiled is not None:
            # through the torch model even where the native step runs decode: the one-token graph
            # still serves the one-token steps it does not cover (prompt logprobs)
            native, self.native = self.native, None
            try:
                self.run([SeqChunk([0, 0], 0, 2, [0, 0])])
                self.run([SeqChunk([0, 0], 1, 1, [0, 0])])
            finally:
                self.native = native
        if self.graph_step is not None:
            capture(self.graph_step)
        self.warmup_s = time.perf_counter() - start  # start-up's "compile" phase (logged by replicas)

    def run(self, chunks: list[SeqChunk], pending: Pending | None = None) -> RunnerOutput:
        """One forward over ``chunks``; a chunk of ``pending`` takes its last token from there."""
        if not self._warned_thread and threading.get_ident() != self._thread:
            self._warned_thread = True
            logger.warning(
                "the model runs on a thread other than the one that built the engine: on CPU "
                "every step is slower (two OpenMP teams); build and step it on one thread"
            )
        if self.native is not None and covers(chunks):
            return self.run_native(chunks, pending)
        if self.graph_step is not None and self.graph_step.covers(chunks):
            return RunnerOutput(self.graph_step.run(chunks, pending), {})
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_new == 1)
        ordered = [chunks[i] for i in order]
        inputs = self.prepare(ordered)
        if pending is not None:  # the last row of each pending chunk, where the ordering put it
            place = {c: i for i, c in enumerate(order)}
            pending.fill(inputs.input_ids, [inputs.spans[place[c]][1] - 1 for c in pending.chunks])
        want_all = [max(c.logits_from - c.num_computed, 0) if c.want_all_logits else None for c in ordered]
        # no_grad, not inference_mode: compiled layers write the pool's K/V through views, which
        # inference tensors do not allow in a traced graph.
        with torch.no_grad():
            if self.compiled is not None:
                last, all_logits = self.compiled.run(self.forward, inputs, want_all)
            else:
                last, all_logits = self.forward(inputs, want_all)
        logits = torch.empty_like(last)
        logits[torch.tensor(order, device=self.device)] = last
        return RunnerOutput(logits, {order[i]: v for i, v in all_logits.items()})

    def run_native(self, chunks: list[SeqChunk], pending: Pending | None = None) -> RunnerOutput:
        """A decode-only step (``native_step.covers``) through the native step: no attention plan, no
        reordering (every chunk is one row)."""
        assert self.native is not None
        ps = self.page_size
        rows = torch.tensor([(c.num_computed, c.token_ids[c.num_computed]) for c in chunks])  # position, id
        positions, ids = rows[:, 0].contiguous(), rows[:, 1].contiguous()
        if pending is not None:
            pending.fill(ids, pending.chunks)
        tables = [c.page_table for c in chunks]
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        pages = table.gather(1, (positions // ps).unsqueeze(1)).squeeze(1).to(torch.int64)
        slots = pages * ps + positions % ps
        with torch.no_grad():
            hidden = self.native.forward(ids, positions, table, (positions + 1).to(torch.int32), slots)
            logits = self.model.compute_logits(hidden)
        return RunnerOutput(logits, {})

    def prepare(self, chunks: list[SeqChunk]) -> StepInputs:
        """Flat token ids and positions, the slot of each new token, and the backend's plan of the step."""
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
        num_extend = sum(1 for c in chunks if c.num_new > 1)
        plan = self.backend.plan_step(
            table.to(torch.int32).to(dev), cu.to(torch.int32).to(dev), seq_lens.to(dev), num_extend, ps
        )
        return StepInputs(
            torch.tensor(flat, dtype=torch.int64, device=dev),
            positions.to(dev),
            AttentionMetadata(slots.to(dev), plan),
            (cu[1:] - 1).to(dev),
            list(itertools.pairwise(cu.tolist())),
        )
