"""The two roles on two in-process engines (no HTTP, no processes): pages computed by the prefill
engine arrive byte-identical in the decode engine's tree, only what the decode engine lacks moves,
a foreign layout or a corrupt chunk is refused, and every page is accounted for on both sides."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from loop_util import Harness, harness

from radixserve.disagg.decode import DecodeRole
from radixserve.disagg.prefill import PrefillRole
from radixserve.disagg.transfer import KVTransferError, TransferHeader, checksum, verify
from radixserve.disagg.transport import KVReceiver, KVSender
from radixserve.engine.engine import Engine
from radixserve.runtime.engine_loop import EngineLoop
from radixserve.runtime.messages import (
    AddRequest,
    CheckIntegrity,
    FromEngine,
    KVReceived,
    KVReserved,
    PrefillDone,
    PrefillKV,
    RequestError,
    StepReport,
)
from radixserve.sampling.params import SamplingParams

PS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(model: Path, **options: Any) -> Engine:
    return Engine(str(model), page_size=PS, num_pages=256, enforce_eager=True, detokenize=True, **options)


def _job(rid: str, prompt: list[int], start: int, end: int, destination: str) -> PrefillKV:
    """The coordinator's job for a reservation ``[start, end)`` (disagg/dispatch.prefill_job)."""
    return PrefillKV(
        request_id=rid,
        prompt_token_ids=prompt[: end + 1],
        cache_salt=None,
        priority=0,
        start=start,
        end=end,
        destination=destination,
    )


class Pair:
    """A prefill and a decode engine with their roles, and the messages each sent to the API server."""

    def __init__(self, prefill: Engine, decode: Engine, transport: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.to_server: list[FromEngine] = []
        self.added: list[AddRequest] = []
        self.arrivals: dict[str, float] = {}  # the arrival time each added request was added with
        self.p_engine, self.d_engine = prefill, decode
        self.prefill = PrefillRole(prefill, self.to_server.append, KVSender(self.ctx))
        self.decode = DecodeRole(
            decode, self.to_server.append, self._add, KVReceiver(self.ctx, transport), timeout_s=30.0
        )

    def _add(self, msg: AddRequest, arrival_time: float) -> bool:
        self.added.append(msg)
        self.arrivals[msg.request_id] = arrival_time
        self.d_engine.add_request(
            msg.prompt_token_ids,
            msg.params,
            msg.request_id,
            msg.cache_salt,
            msg.priority,
            arrival_time=arrival_time,
        )
        return True

    def serve(self, rid: str, prompt: list[int]) -> list[int]:
        """Run one request through both roles, as the coordinator would; its output tokens."""
        self.decode.add_request(AddRequest(request_id=rid, prompt_token_ids=prompt, params=GREEDY))
        return self.serve_reserved(rid, prompt)

    def serve_reserved(self, rid: str, prompt: list[int]) -> list[int]:
        """Run a request the decode role has taken: its prefill job, if it reserved pages, then its
        decode; its output tokens."""
        reserved = [m for m in self.to_server if isinstance(m, KVReserved) and m.request_id == rid]
        if reserved:
            r = reserved[0]
            self.prefill.handle(_job(rid, prompt, r.start, r.end, r.address))
            for _ in range(200):
                if any(isinstance(m, PrefillDone) and m.request_id == rid for m in self.to_server):
                    break
                self.prefill.after_step(self.p_engine.step())
            for _ in range(200):
                self.decode.receiver.socket.poll(50)  # as the loop's poller waits for a chunk
                self.decode.poll()
                if any(
                    isinstance(m, (KVReceived, RequestError)) and m.request_id == rid for m in self.to_server
                ):
                    break
        tokens: list[int] = []
        while self.d_engine.has_unfinished():
            for out in self.decode.after_step(self.d_engine.step()):
                if out.group_id == rid:
                    tokens += out.token_ids
                    self.last = out
        return tokens

    def check(self) -> None:
        self.decode.check_integrity()
        self.p_engine.check_integrity()

    def close(self) -> None:
        self.decode.receiver.close()
        self.prefill.sender.close()
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> Iterator[tuple[Engine, Engine, Engine]]:
    """A prefill engine, a decode engine, and a colocated reference."""
    yield _engine(tiny_llama), _engine(tiny_llama), _engine(tiny_llama)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_outputs_equal_colocated_and_pages_are_byte_identical(
    engines: tuple[Engine, Engine, Engine], transport: str
) -> None:
    p, d, ref = engines
    p.flush_cache(), d.flush_cache()
    pair = Pair(p, d, transport)
    try:
        prompt = [(7 * i + 3) % 200 + 1 for i in range(37)]  # 9 whole pages before the last token
        got = pair.serve("a", prompt)
        want = ref.generate([prompt], GREEDY)[0].token_ids
        assert got == want
        assert pair.last.kv_transfer_tokens == 36 and pair.last.cached_tokens == 0
        received = [m for m in pair.to_server if isinstance(m, KVReceived)]
        assert received and received[0].pages == 9 and received[0].bytes == 9 * d.pool.page_bytes
        # The pages in the decode engine's tree are the prefill engine's, byte for byte.
        key = prompt[:36]
        assert d.kv_manager.tree is not None and p.kv_manager.tree is not None
        d_pages = list(d.kv_manager.tree.match_prefix(key).pages)
        p_pages = list(p.kv_manager.tree.match_prefix(key).pages)
        assert len(d_pages) == len(p_pages) == 9
        d_bytes = d.pool.read_pages(d.runner.backend, d_pages)
        p_bytes = p.pool.read_pages(p.runner.backend, p_pages)
        assert d_bytes.abs().sum() > 0 and torch.equal(d_bytes, p_bytes)
        pair.check()
    finally:
        pair.close()


def test_a_second_turn_moves_only_its_new_suffix(engines: tuple[Engine, Engine, Engine]) -> None:
    p, d, ref = engines
    p.flush_cache(), d.flush_cache()
    pair = Pair(p, d, "shm")
    try:
        first = [(5 * i + 1) % 150 + 1 for i in range(21)]
        out = pair.serve("t1", first)
        assert pair.last.kv_transfer_tokens == 20
        second = first + out + [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]  # 38 tokens: 36 usable
        got = pair.serve("t2", second)
        # The decode engine's tree held the first turn's 20 prompt tokens and the pages its own decode
        # filled (24 of 27): only the pages from there to 36 moved.
        cached = pair.last.cached_tokens
        assert cached == 24 and pair.last.kv_transfer_tokens == 36 - cached
        assert got == ref.generate([second], GREEDY)[0].token_ids
        pair.check()
    finally:
        pair.close()


def test_a_foreign_layout_is_refused_and_frees_the_reservation(tiny_llama: Path) -> None:
    p, d = _engine(tiny_llama, kv_cache_dtype="bfloat16"), _engine(tiny_llama)
    pair = Pair(p, d, "shm")
    try:
        prompt = list(range(1, 30))
        free = d.kv_manager.num_free
        assert pair.serve("x", prompt) == []
        errors = [m for m in pair.to_server if isinstance(m, RequestError)]
        assert errors and errors[0].error.kind == "unavailable"
        assert "layout fingerprint" in errors[0].error.message
        assert not pair.added and not pair.decode.reservations
        assert d.kv_manager.num_free == free
        pair.check()
    finally:
        pair.close()


def test_verify_refuses_a_corrupt_or_misshapen_chunk() -> None:
    records = torch.arange(24, dtype=torch.uint8).view(2, 12)
    header = TransferHeader(
        request_id="r",
        first_page=0,
        num_pages=2,
        page_bytes=12,
        fingerprint=b"f",
        checksum=checksum(records),
        sent_at=0.0,
    )
    verify(header, records, b"f", 12)
    bad = records.clone()
    bad[1, 3] ^= 1
    with pytest.raises(KVTransferError, match="checksum"):
        verify(header, bad, b"f", 12)
    with pytest.raises(KVTransferError, match="fingerprint"):
        verify(header, records, b"g", 12)
    with pytest.raises(KVTransferError, match="records"):
        verify(msgspec.structs.replace(header, num_pages=3), records, b"f", 12)


def test_the_split_flag_takes_two_positive_counts() -> None:
    from radixserve.cli import build_parser
    from radixserve.disagg.coordinator import parse_split

    assert parse_split("2:3") == (2, 3)
    for bad in ("1", "0:1", "1:0", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--disaggregate takes PREFILL:DECODE"):
            parse_split(bad)
    args = build_parser().parse_args(["serve", "--disaggregate", "1:2", "--kv-transport", "tcp"])
    assert args.disaggregate == (1, 2) and args.kv_transport == "tcp"


def test_the_cores_are_split_between_the_engines_prefill_first() -> None:
    from radixserve.disagg.coordinator import split_cpus

    assert split_cpus([0, 1], 1, 1) == ([[0]], [[1]])
    assert split_cpus([0, 1, 2, 3, 4, 5, 6], 2, 1) == ([[0, 1, 2], [3, 4]], [[5, 6]])
    assert split_cpus([4, 5, 6, 7], 1, 2) == ([[4, 5]], [[6], [7]])
    assert split_cpus([0], 1, 1) is None  # fewer cores than engines: they share


def test_a_bad_priority_is_refused_before_any_page_is_reserved(
    engines: tuple[Engine, Engine, Engine],
) -> None:
    from radixserve.errors import InvalidRequestError

    p, d, _ = engines
    pair = Pair(p, d, "shm")
    try:
        msg = AddRequest(
            request_id="bad", prompt_token_ids=list(range(1, 40)), params=GREEDY, priority="urgent"
        )
        with pytest.raises(InvalidRequestError, match="priority"):
            pair.decode.add_request(msg)  # handed to the engine's own admission, which refuses it
        assert not pair.decode.reservations and not pair.to_server
        pair.check()
    finally:
        pair.close()


def test_a_gone_decode_engine_stalls_the_sender_once_then_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A chunk for an address nobody holds waits ``SEND_TIMEOUT_S``, once: the prefill engine's loop
    must not stall per chunk (a dead decode engine's jobs would add up past the hang deadline)."""
    from radixserve.disagg import transport

    monkeypatch.setattr(transport, "SEND_TIMEOUT_S", 0.2)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sender = KVSender(ctx)
    header = TransferHeader(
        request_id="r", first_page=0, num_pages=1, page_bytes=8, fingerprint=b"f", checksum=0, sent_at=0.0
    )
    records = torch.zeros(1, 8, dtype=torch.uint8)
    gone = f"ipc://{tmp_path}/kv"  # a decode engine's address after its process died
    try:
        with pytest.raises(KVTransferError, match="did not take"):
            sender.send(gone, header, records)
        with pytest.raises(KVTransferError, match="is gone"):
            sender.send(gone, header, records)
        receiver = KVReceiver(ctx, "shm")  # a live one is still served
        assert sender.send(receiver.address, header, records) == 8
        receiver.socket.poll(2000)
        assert len(receiver.receive()) == 1
        receiver.close()
    finally:
        sender.close()
        ctx.destroy(linger=0)


def test_an_abort_ends_a_prefill_job_before_it_sends(engines: tuple[Engine, Engine, Engine]) -> None:
    """The request's stream ended (its decode engine died): the prefill engine drops its job, sends
    nothing and answers the one ``PrefillDone``, and its pages stay accounted for."""
    p, d, _ = engines
    p.flush_cache(), d.flush_cache()
    pair = Pair(p, d, "shm")
    try:
        prompt = [(7 * i + 3) % 150 + 1 for i in range(29)]
        pair.decode.add_request(AddRequest(request_id="a", prompt_token_ids=prompt, params=GREEDY))
        [r] = [m for m in pair.to_server if isinstance(m, KVReserved)]
        pair.prefill.handle(_job("a", prompt, r.start, r.end, r.address))
        assert pair.prefill.abort("a")
        assert pair.prefill.after_step(p.step()) == []  # the job's "abort" output is its own
        assert not p.has_unfinished()
        [done] = [m for m in pair.to_server if isinstance(m, PrefillDone)]
        assert done.error is not None and "aborted" in done.error and done.pages == 0
        assert pair.decode.abort("a")  # its stream's Abort frees the reservation
        assert not pair.decode.reservations
        pair.check()
    finally:
        pair.close()


def test_a_cancelled_prefill_job_is_aborted_on_its_engine() -> None:
    """``LocalPrefill``: the request's stream ended while its job ran (the coordinator cancels the
    job's task): the prefill engine is told to drop it. A retry may go to a replaced process."""
    import asyncio

    from radixserve.disagg.dispatch import LocalPrefill
    from radixserve.runtime.messages import Abort

    class Engine_:
        healthy = True
        engine_pid = 100
        standby_pid = None

        def __init__(self) -> None:
            self.sent: list[object] = []

        def send(self, msg: object) -> bool:
            self.sent.append(msg)
            return True

    engine = Engine_()
    pool = LocalPrefill([engine])
    job = _job("c", [1, 2, 3], 0, 2, "x")

    async def run() -> None:
        task = asyncio.create_task(pool.prefill("0@100", job))
        await asyncio.sleep(0.01)
        assert pool.busy(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert engine.sent == [job, Abort(request_id="c")]
    assert not pool.busy(0)

    # A failed engine is not tried again for the job, but its replacement process is (a standby's).
    assert asyncio.run(pool.pick(set())) == "0@100" and asyncio.run(pool.pick({"0@100"})) is None
    engine.engine_pid = 101
    assert asyncio.run(pool.pick({"0@100"})) == "0@101"


def test_a_request_without_room_waits_for_its_reservation_instead_of_being_computed_here(
    tiny_llama: Path, engines: tuple[Engine, Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool held by one reservation has no room for a second's pages: the second is not computed
    on the decode engine (the prefill work the decode role exists to keep away) but waits, and is
    reserved once the first's pages are free; past ROOM_WAIT_S one is computed here after all."""
    from radixserve.disagg import decode

    p, _, _ = engines
    d = Engine(str(tiny_llama), page_size=PS, num_pages=16, enforce_eager=True, detokenize=True)
    pair = Pair(p, d, "shm")
    try:
        first, second, third = ([(k * 7 + i) % 150 + 1 for i in range(40)] for k in (1, 2, 3))
        pair.decode.add_request(AddRequest(request_id="a", prompt_token_ids=first, params=GREEDY))
        pair.decode.add_request(AddRequest(request_id="b", prompt_token_ids=second, params=GREEDY))
        pair.decode.poll()
        reserved = [m.request_id for m in pair.to_server if isinstance(m, KVReserved)]
        assert reserved == ["a"] and not pair.added  # b neither reserved nor computed here
        assert [m.request_id for m, _ in pair.decode.waiting_for_room] == ["b"]
        pair.check()
        assert pair.decode.abort("a")  # its pages free
        pair.decode.poll()
        reserved = [m.request_id for m in pair.to_server if isinstance(m, KVReserved)]
        assert reserved == ["a", "b"] and not pair.decode.waiting_for_room and not pair.added
        pair.check()

        for rid in ("c", "e"):
            pair.decode.add_request(AddRequest(request_id=rid, prompt_token_ids=third, params=GREEDY))
        assert not pair.added and [m.request_id for m, _ in pair.decode.waiting_for_room] == ["c", "e"]
        assert pair.decode.abort("e")  # a waiting one is dropped: nothing else to abort
        monkeypatch.setattr(decode, "ROOM_WAIT_S", -1.0)  # waited past the bound
        pair.decode.poll()
        assert [m.request_id for m in pair.added] == ["c"] and not pair.decode.waiting_for_room
        assert pair.decode.abort("b")
        d.abort("c")
        pair.check()
    finally:
        pair.close()


def test_a_wait_for_room_or_for_pages_is_overdue_from_its_arrival_and_keeps_it(
    tiny_llama: Path, engines: tuple[Engine, Engine, Engine]
) -> None:
    """A request waiting for room and one waiting for its pages are both the decode engine's waiting
    requests: past ``max_queue_wait_s`` from their arrival here they are overdue, and aborting them
    frees what they hold. The one reserved later, and the engine request it becomes, keep its arrival."""
    p, _, _ = engines
    d = Engine(str(tiny_llama), page_size=PS, num_pages=16, enforce_eager=True, detokenize=True)
    pair = Pair(p, d, "shm")
    try:
        first, second = ([(k * 7 + i) % 150 + 1 for i in range(40)] for k in (1, 2))
        pair.decode.add_request(AddRequest(request_id="a", prompt_token_ids=first, params=GREEDY))
        pair.decode.add_request(AddRequest(request_id="b", prompt_token_ids=second, params=GREEDY))
        [(_, b_came)] = pair.decode.waiting_for_room
        assert pair.decode.overdue(3600.0) == []
        assert sorted(pair.decode.overdue(0.0)) == ["a", "b"]
        assert pair.decode.abort("a")  # as the loop drops an overdue one: its pages free
        pair.check()
        pair.decode.poll()  # b is reserved now, with the time it came
        assert pair.decode.reservations["b"].arrived == b_came
        assert pair.decode.overdue(0.0) == ["b"]
        assert pair.prefill.overdue(0.0) == []  # a job is bounded by its decode engine, never here
        got = pair.serve_reserved("b", second)
        assert got and pair.arrivals["b"] == b_came  # the engine's queue counts from then too
        pair.check()
    finally:
        pair.close()


def _messages_until(
    h: Harness, done: Callable[[FromEngine], bool], timeout_s: float = 30.0
) -> list[FromEngine]:
    """What the loop sent, until ``done`` says so (or fail after ``timeout_s``)."""
    got: list[FromEngine] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = h.receive(int(timeout_s * 1000))
        got.append(msg)
        if done(msg):
            return got
    raise AssertionError(f"not done after {timeout_s} s: {[type(m).__name__ for m in got]}")


def test_a_reservation_past_max_queue_wait_s_gets_the_queue_timeout_and_frees_its_pages(
    tiny_llama: Path,
) -> None:
    """No prefill engine ever sends the pages: the request is answered with the wait's 429 after
    ``max_queue_wait_s``, not the 503 of the KV timeout minutes later, and its pages are free."""
    d = _engine(tiny_llama, max_queue_wait_s=0.2)

    def role(loop: EngineLoop) -> DecodeRole:
        return DecodeRole(loop.engine, loop.send, loop.add, KVReceiver(loop.context, "shm"))

    with harness(d, role) as h:
        prompt = [(7 * i + 3) % 200 + 1 for i in range(37)]
        h.send(AddRequest(request_id="r", prompt_token_ids=prompt, params=GREEDY))
        got = _messages_until(h, lambda m: isinstance(m, RequestError))
        assert any(isinstance(m, KVReserved) and m.request_id == "r" for m in got)
        error = got[-1]
        assert isinstance(error, RequestError) and error.request_id == "r"
        assert error.error.kind == "queue_timeout" and "max_queue_wait_s" in error.error.message
        h.call(CheckIntegrity())  # the reservation's pages were counted back
        assert d.kv_manager.num_in_use == 0


def _finished(msg: StepReport, rid: str) -> bool:
    return any(o.group_id == rid and o.finish_reason is not None for o in msg.outputs)


def test_max_queue_wait_s_never_drops_a_prefill_job(tiny_llama: Path) -> None:
    """A job that waits past ``max_queue_wait_s`` behind a running request is still computed and sent:
    dropped there, it failed as "pages not computed" (a 503) and sent a stray error for its own id."""
    p = _engine(tiny_llama, max_queue_wait_s=0.05, max_running_requests=1)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    receiver = KVReceiver(ctx, "shm")

    def role(loop: EngineLoop) -> PrefillRole:
        return PrefillRole(loop.engine, loop.send, KVSender(loop.context))

    try:
        with harness(p, role) as h:
            hold = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            h.send(AddRequest(request_id="hold", prompt_token_ids=[5, 6, 7], params=hold))
            _messages_until(h, lambda m: isinstance(m, StepReport) and "hold" in m.scheduled)
            prompt = [(7 * i + 3) % 200 + 1 for i in range(37)]
            h.send(_job("j", prompt, 0, 36, receiver.address))
            sent = time.monotonic()
            got = _messages_until(h, lambda m: isinstance(m, PrefillDone))
            waited = time.monotonic() - sent
            done = got[-1]
            assert isinstance(done, PrefillDone)
            assert not [m for m in got if isinstance(m, RequestError)]
            assert done.error is None and done.pages == 9
            # It waited past the limit behind the running request: the case this is about.
            assert waited > 0.05 and any(isinstance(m, StepReport) and _finished(m, "hold") for m in got)
    finally:
        receiver.close()
        ctx.destroy(linger=0)
