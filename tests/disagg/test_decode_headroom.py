"""Decode headroom (issue 59): reservations waiting on a prefill engine never starve the requests the
decode engine runs; they keep stepping to their last token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from radixserve.disagg import headroom
from radixserve.disagg.decode import DecodeRole
from radixserve.disagg.transport import KVReceiver
from radixserve.engine.engine import Engine
from radixserve.runtime.messages import AddRequest, FromEngine, KVReserved
from radixserve.sampling.params import SamplingParams

PS = 4
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class Decode:
    """A decode engine and its role, no prefill engine: no page is ever sent, so every reservation
    waits for as long as the test runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sent: list[FromEngine] = []
        self.role = DecodeRole(engine, self.sent.append, self._add, KVReceiver(self.ctx, "shm"), 600.0)

    def _add(self, msg: AddRequest, arrival_time: float) -> bool:
        self.engine.add_request(msg.prompt_token_ids, msg.params, msg.request_id, arrival_time=arrival_time)
        return True

    def reserved(self) -> list[str]:
        return [m.request_id for m in self.sent if isinstance(m, KVReserved)]

    def close(self) -> None:
        self.role.receiver.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def decode(tiny_llama: Path) -> Iterator[Decode]:
    d = Decode(Engine(str(tiny_llama), page_size=PS, num_pages=32, enforce_eager=True))
    try:
        yield d
    finally:
        d.close()


def _prompt(k: int, n: int) -> list[int]:
    return [(k * 11 + 3 * i) % 200 + 1 for i in range(n)]


def test_running_requests_step_to_their_end_while_reservations_wait(decode: Decode) -> None:
    """Two requests run here (each will grow to 12 of the 32 pages), then five requests arrive whose
    prompts are to come from a prefill engine that never sends (9 pages each). Reserving whenever pages
    could be had, the reservations took the pages the running requests grow into, then the pages each
    preempted one left cached: 0 running, 2 waiting, the pool held by reservations. With the headroom
    both run to their 40th token, and the reservations have the pages as the requests end."""
    engine, role = decode.engine, decode.role
    for k in range(2):
        engine.add_request(_prompt(k, 8), LONG, f"run{k}")
    engine.step()  # both admitted: their prompts computed, their first tokens sampled
    for k in range(5):
        role.add_request(AddRequest(request_id=f"far{k}", prompt_token_ids=_prompt(10 + k, 37), params=SHORT))
    assert decode.reserved(), "some pages are reserved at once: the headroom is not the whole pool"
    tokens = {f"run{k}": 1 for k in range(2)}
    idle = 0
    for _ in range(200):
        role.poll()
        outputs = role.after_step(engine.step())
        for o in outputs:
            tokens[o.group_id] = tokens.get(o.group_id, 0) + len(o.token_ids)
        idle += not any(o.group_id in tokens for o in outputs)  # a step that made none of their tokens
        role.check_integrity()
        if all(tokens[f"run{k}"] >= 40 for k in range(2)):
            break
    assert idle == 0, "a step ran none of the engine's requests while reservations held the pool"
    assert tokens == {"run0": 40, "run1": 40}
    assert len(role.reservations) + len(role.waiting_for_room) == 5  # nothing was ever sent
    role.poll()
    assert len(role.reservations) >= 3  # the pages the two left went to the reservations
    kv = engine.kv_manager
    assert kv.num_free + kv.num_cached + kv.num_in_use == kv.num_pages
    for k in range(5):
        role.abort(f"far{k}")
    role.check_integrity()
    assert kv.num_in_use == 0


def test_the_headroom_counts_each_request_up_to_its_max_tokens_and_is_bounded(decode: Decode) -> None:
    """Per request, its next HEADROOM_TOKENS tokens up to its max_tokens, beyond the pages it holds (a
    waiting one: beyond its received prefix, which the role keeps locked); in all at most
    HEADROOM_SHARE of the pool, but never less than the largest single request's need."""
    engine = decode.engine
    assert headroom.headroom_pages(engine) == 0  # nothing here: every page may be reserved
    engine.add_request(_prompt(1, 8), SHORT, "short")
    engine.step()  # 8 tokens computed in 2 pages, a 9th sampled: 12 in all need 1 more page
    assert headroom.headroom_pages(engine) == 1
    big = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    engine.add_request(_prompt(2, 8), big, "big")
    engine.step()  # short: 10 tokens in 3 pages, its 12 fit; big: 9 tokens in 2 pages
    assert headroom.headroom_pages(engine, ahead=32) == 9  # big: 41 tokens, 11 pages, 9 more
    assert headroom.headroom_pages(engine) == 17  # big: 73 tokens, 17 more: over the bound (16)
    engine.add_request(_prompt(3, 8), big, "big2")
    engine.step()  # big: 10 tokens in 3 pages; big2: 9 in 2
    assert headroom.headroom_pages(engine, ahead=32) == 16  # 8 + 9, bounded by half the pool
    (waiting,) = engine.intake.make(_prompt(4, 37), SHORT, "landed", None, 0, None)
    assert headroom.request_need(waiting, 0, PS) == 11  # 37 + 4 tokens, none held
    assert headroom.request_need(waiting, 36, PS) == 2  # its 36 received tokens held: 41 tokens
