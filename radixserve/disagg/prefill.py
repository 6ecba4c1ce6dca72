"""The prefill role: inside a prefill engine process's loop, compute prompts and send their KV pages.

A ``PrefillKV`` becomes an engine request for ``prompt[:end + 1]`` with one greedy token: the engine
matches its own tree, computes the rest chunk by chunk, and inserts each chunk's whole pages into its
tree as soon as they are computed (``KVCacheManager.cache_computed``). After every step this role sends
the pages of ``[start, end)`` that have reached the tree since the last: the transfer runs per chunk,
beside the computation. The token sampled here is thrown away: the decode engine samples the first
token (docs/scaling.md says why).

Invariants:
- Pages are read between two steps, on the loop's thread, from the tree: whole, computed pages that
  no step can change; nothing is read that the decode engine already holds (below ``start``).
- Every job ends with exactly one ``PrefillDone``: all pages sent, or an error saying why not (an
  ``Abort`` of its request ends it too: its stream ended, so nobody waits for its pages).
- The job's own request never reaches the API server's streams: its outputs are taken out here, and
  ``max_queue_wait_s`` never drops it (the decode engine bounds the wait: ``overdue``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.disagg.transfer import KVTransferError, TransferHeader, checksum, layout_fingerprint
from radixserve.disagg.transport import KVSender
from radixserve.engine.deltas import StepOutput
from radixserve.runtime.engine_loop import EngineRole, RoleMessage
from radixserve.runtime.messages import FromEngine, PrefillDone, PrefillKV
from radixserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.disagg")

JOB_SUFFIX = "#prefill"  # the engine request of a job: its request id with this suffix


@dataclass
class _Job:
    msg: PrefillKV
    sent: int  # tokens of the prompt whose pages the decode engine has (start, then what was sent)
    pages: int = 0
    bytes: int = 0


class PrefillRole(EngineRole):
    """Runs the ``PrefillKV`` jobs of one engine; ``send`` reaches the API server."""

    def __init__(self, engine: Engine, send: Callable[[FromEngine], None], sender: KVSender) -> None:
        if not engine.kv_manager.prefix_cache:
            raise ValueError("a prefill engine needs the prefix cache (drop --no-prefix-cache)")
        super().__init__(engine)
        self._send = send
        self.sender = sender
        self.fingerprint = layout_fingerprint(engine)
        self._jobs: dict[str, _Job] = {}  # by engine request id

    def handle(self, msg: RoleMessage) -> None:
        if not isinstance(msg, PrefillKV):
            return super().handle(msg)
        ps = self.engine.config.page_size
        if msg.start % ps or msg.end % ps or not 0 <= msg.start < msg.end < len(msg.prompt_token_ids):
            self._done(_Job(msg, msg.start), f"bad page range [{msg.start}, {msg.end}) for page size {ps}")
            return
        job = _Job(msg, msg.start)
        rid = msg.request_id + JOB_SUFFIX
        if rid in self._jobs:  # sent again while still running here: send its pages from the start
            self._jobs[rid] = job
            return
        params = SamplingParams(max_tokens=1, temperature=0.0, speculative=False)
        try:
            self.engine.add_request(msg.prompt_token_ids, params, rid, msg.cache_salt, msg.priority)
        except ValueError as exc:  # InvalidRequestError included: the prompt cannot be computed here
            self._done(job, f"the prefill engine refused the prompt: {exc}")
            return
        self._jobs[rid] = job

    def abort(self, request_id: str) -> bool:
        """The job of ``request_id`` (its stream ended: a dead decode engine, a gone client) stops
        computing and sending. True: nothing more to abort."""
        job = self._jobs.pop(request_id + JOB_SUFFIX, None)
        if job is not None:
            self.engine.abort(request_id + JOB_SUFFIX)
            self._done(job, "aborted: its request ended")
        return True

    def after_step(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Send what the step added to the tree; finish the jobs whose request ended. Returns the
        outputs that are not the jobs'."""
        finished = {o.group_id for o in outputs if o.group_id in self._jobs and o.finish_reason is not None}
        for rid, job in list(self._jobs.items()):
            try:
                self._send_new_pages(job)
            except KVTransferError as exc:
                self.engine.abort(rid)
                del self._jobs[rid]
                self._done(job, str(exc))
                continue
            if rid in finished:
                del self._jobs[rid]
                missing = job.msg.end - job.sent
                self._done(job, None if missing == 0 else f"{missing} tokens' pages were not computed")
        return [o for o in outputs if not o.group_id.endswith(JOB_SUFFIX)]

    def overdue(self, max_wait_s: float) -> list[str]:
        """None: a job is not a client's request. The decode engine that reserved its pages bounds the
        request's wait (a reservation counts as waiting there), and its failure ends the job (an
        ``Abort``). Dropped here, the job failed as "pages not computed": a 503, not the wait's 429."""
        return []

    def close(self) -> None:
        self.sender.close()

    def _send_new_pages(self, job: _Job) -> None:
        msg = job.msg
        tree = self.engine.kv_manager.tree
        tokens = msg.prompt_token_ids[: msg.end]
        have = tree.peek(tokens, msg.cache_salt).num_tokens
        if have <= job.sent:
            return
        ps = self.engine.config.page_size
        match = tree.match_prefix(tokens[:have], msg.cache_salt)
        pages = list(match.pages[job.sent // ps : have // ps])
        sent_at = time.time()
        records = self.engine.pool.read_pages(self.engine.runner.backend, pages).cpu()
        header = TransferHeader(
            request_id=msg.request_id,
            first_page=job.sent // ps,
            num_pages=len(pages),
            page_bytes=self.engine.pool.page_bytes,
            fingerprint=self.fingerprint,
            checksum=checksum(records),
            sent_at=sent_at,
        )
        job.bytes += self.sender.send(msg.destination, header, records)
        job.pages += len(pages)
        job.sent = have

    def _done(self, job: _Job, error: str | None) -> None:
        if error is not None:
            logger.warning("prefill of request %s failed: %s", job.msg.request_id, error)
        self._send(PrefillDone(request_id=job.msg.request_id, pages=job.pages, bytes=job.bytes, error=error))
