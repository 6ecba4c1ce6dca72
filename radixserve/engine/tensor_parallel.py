"""Tensor parallelism (``tensor_parallel_size N``): one engine over N ranks, each holding a shard of the
model (``model/sharding.py``) and a KV pool of its KV heads with the same page ids.

- Rank 0 is the engine's own process and thread: it alone has the scheduler, the radix tree, the tiers'
  bookkeeping and the sampler. Ranks 1..N-1 are worker processes, started with spawn (a forked copy of
  a process with OpenMP and ZMQ threads is not safe), that only run what rank 0 sends them.
- A step: rank 0 sends each worker the step's plan over a pipe (every chunk's new token ids, how many
  tokens it has computed, its page table, whether all its logits are wanted: what ``ModelRunner``
  builds the step's tensors from, so every rank builds the same ones), then every rank runs the same
  forward on its shard. The collectives inside it (an fp32 all-reduce after each row-parallel product
  and after the embedding, the logits' gather to rank 0) keep the ranks in lockstep; the captured step
  (``model/compiled.py``) holds them as opaque ops (``parallel/comm.py``).
- The tiers: rank 0's ``TierController`` sees the pool through ``ShardedPages``: reading pages sends
  ("read", pages) to the workers and each rank copies its own shard of them out of its pool; the byte
  records are gathered on rank 0, one record per page holding every rank's shard in rank order (the
  disk tier's fingerprint includes the TP size, so no other layout's records are read). Writing
  scatters each record's parts back, each rank into its own pool. Loads land on the stepping thread
  (``TierController(scatter_on_land=True)``): collectives run on one thread only.
- Threads: each rank takes ``cores / N`` of the cores the engine may use (at least one) and binds to
  them; rank 0's old binding comes back at ``close``.
- Failure: a worker that dies (or a collective that fails or times out, ``comm.COLLECTIVE_TIMEOUT_S``)
  raises ``TensorParallelError`` from the step, naming the rank; in the engine process that ends the
  process, and the API server fails every request in flight and restarts it. A worker exits when rank
  0's process is gone (its parent changes, or the group's connections close). A rank's failure names
  its exit code or signal and the last line of the error it sent; one that could not start because it
  re-ran an unguarded main script is ``MainScriptError`` (``parallel/spawn.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from radixserve.cache.page_pool import KVPool, PageCopier
from radixserve.config import EngineConfig
from radixserve.engine.heap_trim import HeapTrim
from radixserve.model.attention import AttentionBackend
from radixserve.model.compiled import CompiledLayers
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.pending import Pending
from radixserve.model.runner import ModelRunner, RunnerOutput, SeqChunk
from radixserve.model.sharding import check_tensor_parallel, local_kv_heads, shard_model
from radixserve.parallel import comm
from radixserve.parallel.cpus import bind_process, rank_cores
from radixserve.parallel.spawn import MainScriptError, main_script_error

logger = logging.getLogger("radixserve.engine")

WireChunk = tuple[list[int], int, list[int], bool]  # new token ids, computed, page table, all logits
# How long a rank whose pipe closed gets to exit (tearing down with torch loaded, on a loaded machine).
EXIT_WAIT_S = 10.0
STOP_WAIT_S = 10.0  # how long a healthy rank gets to finish its last command when the engine closes


class TensorParallelError(RuntimeError):
    """A rank of the engine died, or a collective between them failed: the engine cannot go on."""


def _wire(chunks: list[SeqChunk]) -> list[WireChunk]:
    return [
        (
            c.token_ids[c.num_computed : c.num_computed + c.num_new],
            c.num_computed,
            c.page_table,
            c.want_all_logits,
        )
        for c in chunks
    ]


def _unwire(wire: list[WireChunk]) -> list[SeqChunk]:
    # The runner reads only the new tokens of a chunk: the computed ones are placeholders here.
    return [SeqChunk([0] * done + new, done, len(new), table, want) for new, done, table, want in wire]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank: the engine's config and what rank 0 resolved."""

    config: EngineConfig
    model_path: str
    port: int
    cores: list[int]  # the engine's usable cores, each rank binding to its share


def create(
    config: EngineConfig, model_path: Path, model: LlamaForCausalLM, device: torch.device
) -> SingleRank | TensorParallel:
    """The ranks for ``config.tensor_parallel_size``, ``model`` (loaded whole) sharded to rank 0's part;
    at size 1, ``SingleRank``: no group, no worker, nothing on the step's path."""
    if config.tensor_parallel_size == 1:
        return SingleRank(model.config.num_kv_heads)
    return TensorParallel(config, model_path, model, device)


class SingleRank:
    """Tensor parallelism of size 1: the engine's pool, runner and tiers as they are."""

    size = 1

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = kv_heads

    def pages(self, pool: KVPool) -> KVPool:
        return pool

    def lead(self, runner: ModelRunner) -> ModelRunner:
        runner.warmup()
        return runner

    def close(self) -> None:
        pass


class TensorParallel:
    """Rank 0's side: the workers, the group, and the step and page commands sent to them."""

    def __init__(
        self, config: EngineConfig, model_path: Path, model: LlamaForCausalLM, device: torch.device
    ) -> None:
        n = self.size = config.tensor_parallel_size
        check_tensor_parallel(model.config, n, model.quantization)
        self.kv_heads = local_kv_heads(model.config, n)
        # Workers use the arithmetic rank 0 resolved ("auto" probes: two ranks could choose apart).
        config = dataclasses.replace(config, prefill_arithmetic=model.arithmetic, preset=None)
        spec = WorkerSpec(config, str(model_path), _free_port(), sorted(os.sched_getaffinity(0)))
        self._cores = rank_cores(0, n, spec.cores)  # bound once every rank is ready (bind_process)
        self._restore: tuple[set[int], int] | None = (os.sched_getaffinity(0), torch.get_num_threads())
        self._failed = False  # a rank died or a collective failed: the group cannot go on
        torch.set_num_threads(len(self._cores))  # one torch thread per core
        ctx = mp.get_context("spawn")
        self.workers: list[tuple[int, BaseProcess, Connection]] = []
        for rank in range(1, n):
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(spec, rank, child), name=f"radixserve-tp-rank{rank}", daemon=True
            )
            proc.start()
            child.close()
            self.workers.append((rank, proc, conn))
        try:
            self._await("joining")  # each about to join: one that failed before says so
            comm.init_group(0, n, spec.port, device)
        except (TensorParallelError, MainScriptError):
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise self.failure(exc) from exc
        shard_model(model, 0, n)
        logger.info("tensor parallel: %d ranks, worker pids %s", n, [p.pid for _, p, _ in self.workers])

    def lead(self, runner: ModelRunner) -> LeadRunner:
        """Rank 0's ``runner``, warmed up with the workers' (theirs are built now, with pools like its)."""
        self.send("start", (runner.pool.num_pages, runner.pool.kv_dtype))
        try:
            runner.warmup()
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        self._await("ready")  # the engine is ready once every rank is
        bind_process(self._cores)
        return LeadRunner(runner, self)

    def _await(self, word: str) -> None:
        """Wait until every worker has said ``word``; a worker that died or failed first raises."""
        for rank, proc, conn in self.workers:
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise self.failure(None)
            try:
                kind, text = conn.recv()
            except (EOFError, OSError):  # it closed its end: it is exiting, its exit code says why
                raise self.failure(None, exiting=rank) from None
            if kind != word:
                raise self.failure(None, exiting=rank, said=text if kind == "error" else "")

    def pages(self, pool: KVPool) -> ShardedPages:
        return ShardedPages(self, pool)

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p, _ in self.workers if p.pid is not None]

    def send(self, command: str, arg: Any) -> None:
        """Hand every worker one command (they run it in the order sent)."""
        for _, proc, conn in self.workers:
            if not proc.is_alive():
                raise self.failure(None)
            try:
                conn.send((command, arg))
            except OSError as exc:
                raise self.failure(exc) from exc

    def failure(
        self, exc: BaseException | None, exiting: int | None = None, said: str = ""
    ) -> TensorParallelError | MainScriptError:
        """The error to raise after a failed command or collective: a dead rank's, with its exit code or
        signal and the last line of the error it sent (``said`` by rank ``exiting``, whose pipe closed
        so its exit is due, or one still in its pipe), else the collective's; never an empty reason.
        The group is failed from then on (``close`` kills the ranks left)."""
        self._failed = True
        for rank, proc, conn in self.workers:
            proc.join(EXIT_WAIT_S if rank == exiting else 0.5 if exc is not None else 0)
            if proc.exitcode is None:
                continue
            text = said if rank == exiting else ""
            with contextlib.suppress(OSError, EOFError):
                if not text and conn.poll():
                    kind, sent = conn.recv()
                    text = sent if kind == "error" else ""
            return main_script_error(rank, proc.exitcode) or TensorParallelError(
                f"tensor-parallel rank {rank} (pid {proc.pid}) {_exit_text(proc.exitcode)}{_last_line(text)}"
            )
        if exiting is not None:  # it said why (or closed its pipe) but has not exited yet
            why = _last_line(said) or ": it closed its pipe"
            return TensorParallelError(f"tensor-parallel rank {exiting} failed{why}")
        reason = "no rank has exited" if exc is None else str(exc) or type(exc).__name__
        alive = [rank for rank, proc, _ in self.workers if proc.is_alive()]
        return TensorParallelError(
            f"a collective between the tensor-parallel ranks failed: {reason} (ranks {alive} still running)"
        )

    def close(self) -> None:
        """Stop the workers and leave the group. Each finishes its last command first, unless the group
        failed (``failure``: a rank died, or a collective failed): then those left are killed at once.
        One of them waiting in a collective for a rank that is gone never reads "stop", so closing
        waited STOP_WAIT_S for it, and the engine process's exit with it: past the 5 s hang deadline,
        a soak's rank kill was taken for a hang and recovered in 15.8 s."""
        for _, proc, conn in self.workers:
            with contextlib.suppress(OSError):
                if proc.is_alive() and not self._failed:
                    conn.send(("stop", None))
        for _, proc, conn in self.workers:
            proc.join(0 if self._failed else STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self.workers = []
        comm.destroy_group()
        if self._restore is not None:
            bind_process(self._restore[0])
            torch.set_num_threads(self._restore[1])
            self._restore = None


class LeadRunner:
    """Rank 0's runner: each step's plan goes to the workers, then the forward runs here."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel) -> None:
        self.runner, self.tp = runner, tp

    @property
    def backend(self) -> AttentionBackend:
        """Rank 0's attention backend (its page copies move rank 0's shard only)."""
        return self.runner.backend

    @property
    def compiled(self) -> CompiledLayers | None:
        """Rank 0's compiled layers (every rank compiles its own shard alike)."""
        return self.runner.compiled

    @property
    def warmup_s(self) -> float:
        """Rank 0's warm-up (compile) time; the workers warm up in step with it."""
        return self.runner.warmup_s

    def run(self, chunks: list[SeqChunk], pending: Pending | None = None) -> RunnerOutput:
        # The workers take token ids from rank 0's host, so no token may be pending (builder.overlapped).
        assert pending is None, "tensor parallelism runs the plain loop"
        self.tp.send("run", _wire(chunks))
        try:
            return self.runner.run(chunks)
        except RuntimeError as exc:  # torch.distributed's errors (a closed peer, a timeout)
            raise self.tp.failure(exc) from exc


class ShardedPages:
    """The pool as rank 0's tiers see it: a page's byte record is every rank's record of it, in rank
    order (``page_bytes`` is N times a rank's)."""

    def __init__(self, tp: TensorParallel, pool: KVPool) -> None:
        self.tp, self.pool = tp, pool
        self.page_size, self.kv_dtype, self.k_buffer = pool.page_size, pool.kv_dtype, pool.k_buffer
        self.page_bytes = pool.page_bytes * tp.size
        self.shards = tp.size

    def read_pages(self, copier: PageCopier, pages: list[int]) -> torch.Tensor:
        self.tp.send("read", pages)
        try:
            out = comm.gather_rows(self.pool.read_pages(copier, pages))
        except RuntimeError as exc:
            raise self.tp.failure(exc) from exc
        assert out is not None
        return out

    def write_pages(self, copier: PageCopier, pages: list[int], records: torch.Tensor) -> None:
        self.tp.send("write", pages)
        device = self.pool.k_buffer.device  # NCCL moves device tensors only
        like = torch.empty(len(pages), self.pool.page_bytes, dtype=torch.uint8, device=device)
        try:
            own = comm.scatter_rows(records.to(device).contiguous(), like)
        except RuntimeError as exc:
            raise self.tp.failure(exc) from exc
        self.pool.write_pages(copier, pages, own)


def _exit_text(code: int) -> str:
    """A dead process's exit in words: its exit code, or the signal that killed it."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"died of {signal.Signals(-code).name}"
        return f"died of signal {-code}"
    return f"died with exit code {code}"


def _last_line(text: str) -> str:
    """ ": <the last line of text>", or "" for none (a traceback's last line names the error)."""
    return "".join(f": {line}" for line in text.strip().splitlines()[-1:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the worker ranks -------------------------------------------------------------------------------
def worker_main(spec: WorkerSpec, rank: int, conn: Connection) -> None:
    """A worker rank's process: join the group, build the rank's shard, pool and runner (warming it up in
    step with rank 0), then run rank 0's commands until told to stop or rank 0 is gone."""
    try:
        _serve(spec, rank, conn)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        comm.destroy_group()


def _serve(spec: WorkerSpec, rank: int, conn: Connection) -> None:
    from radixserve.model import arithmetic
    from radixserve.model.attention import select_backend
    from radixserve.model.loader import load_model, resolve_device_dtype

    cfg, n, parent = spec.config, spec.config.tensor_parallel_size, os.getppid()
    cores = rank_cores(rank, n, spec.cores)
    torch.set_num_threads(len(cores))
    device, dtype_name = resolve_device_dtype(cfg.device, cfg.dtype)
    conn.send(("joining", None))
    comm.init_group(rank, n, spec.port, device)
    model = load_model(Path(spec.model_path), getattr(torch, dtype_name), device, cfg.quantization)
    arithmetic.apply(model, cfg.prefill_arithmetic, many_rows=cfg.max_running_requests)
    shard_model(model, rank, n)
    command, (num_pages, kv_dtype) = conn.recv()  # rank 0 has sized its pool
    assert command == "start", command
    mcfg = model.config
    pool = KVPool(
        mcfg.num_layers, num_pages, cfg.page_size, local_kv_heads(mcfg, n), mcfg.head_dim, kv_dtype, device
    )
    backend = select_backend(cfg.attention_backend, device)
    runner = ModelRunner(model, pool, backend, device, not cfg.enforce_eager and backend.compilable)
    runner.warmup()
    bind_process(cores)
    conn.send(("ready", None))
    like = torch.empty(0, pool.page_bytes, dtype=torch.uint8, device=device)
    heap = HeapTrim(cfg.heap_trim_s)  # as rank 0's engine loop does, between two commands
    while True:
        heap.maybe()
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return  # rank 0's process is gone
            continue
        command, arg = conn.recv()
        if command == "run":
            runner.run(_unwire(arg))
        elif command == "read":
            comm.gather_rows(pool.read_pages(backend, arg))
        elif command == "write":
            pool.write_pages(backend, arg, comm.scatter_rows(None, like.new_empty(len(arg), pool.page_bytes)))
        elif command == "stop":
            return
