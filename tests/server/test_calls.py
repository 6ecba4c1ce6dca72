"""The one call/result RPC between the API server and the engine process, in one process: ``Calls`` (the
API server's future registry) against a real ``EngineLoop`` on a thread, over inproc sockets. Each op's
value comes back as the op's own type; an error comes back typed (its kind, parameter and code), never
as text to parse; the role hooks see the messages and requests meant for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
from loop_util import harness

from radixserve.cache.pins.types import PinInfo, PrefixEviction
from radixserve.cache.radix.view import CacheTree
from radixserve.engine.engine import Engine
from radixserve.errors import InvalidRequestError, PinBudgetError
from radixserve.runtime.calls import EngineCallError
from radixserve.runtime.engine_loop import EngineRole, RoleMessage
from radixserve.runtime.messages import (
    AddRequest,
    AdvancePinClock,
    CallOp,
    CancelTransfer,
    CheckIntegrity,
    EngineOp,
    Evict,
    FlushCache,
    ListPins,
    PrefillKV,
    RequestError,
    TreeQuery,
    Unpin,
)
from radixserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return Engine(str(tiny_llama), page_size=4, num_pages=64, enforce_eager=True, detokenize=True)


def test_every_op_is_in_the_wire_union_and_names_its_result_type() -> None:
    ops = set(CallOp.__subclasses__())
    assert ops == set(get_args(EngineOp))  # an op outside the union could not be decoded by the engine
    assert {op: op.returns for op in ops} == {
        FlushCache: bool,
        CheckIntegrity: type(None),
        TreeQuery: CacheTree,
        ListPins: list[PinInfo],
        Unpin: bool,
        Evict: PrefixEviction,
        AdvancePinClock: type(None),
    }


def test_each_call_returns_its_ops_type(engine: Engine) -> None:
    with harness(engine) as h:
        assert h.call(FlushCache()) is True
        tree = h.call(TreeQuery(namespace_prefix=None, depth=4, min_tokens=0))
        assert isinstance(tree, CacheTree)
        assert h.call(ListPins(namespace=None)) == []
        assert h.call(Unpin(pin_id="nope", namespace=None)) is False
        evicted = h.call(Evict(token_ids=[1, 2, 3, 4], namespace=None))
        assert isinstance(evicted, PrefixEviction) and evicted.freed_pages == 0
        assert h.call(AdvancePinClock(seconds=1.0)) is None
        assert h.call(CheckIntegrity()) is None


class Refusing(EngineRole):
    """A role whose integrity check raises ``error``; it takes every request and records its messages."""

    def __init__(self, engine: Engine, error: Exception | None = None) -> None:
        super().__init__(engine)
        self.error = error
        self.taken: list[str] = []
        self.handled: list[RoleMessage] = []

    def check_integrity(self) -> None:
        if self.error is not None:
            raise self.error

    def add_request(self, msg: AddRequest) -> bool:
        self.taken.append(msg.request_id)
        return True

    def handle(self, msg: RoleMessage) -> None:
        self.handled.append(msg)


@pytest.mark.parametrize(
    ("raised", "expected", "fields"),
    [
        (AssertionError("private page count 3 != 2 held"), EngineCallError, None),
        (
            PinBudgetError("over the budget", "cache_pin", "pin_budget"),
            PinBudgetError,
            ("cache_pin", "pin_budget"),
        ),
        (InvalidRequestError("bad depth", "depth", "too_deep"), InvalidRequestError, ("depth", "too_deep")),
        (ValueError("cache_pin: words that name a field"), InvalidRequestError, (None, None)),
    ],
)
def test_a_failing_call_comes_back_typed_and_the_engine_serves_on(
    engine: Engine, raised: Exception, expected: type[Exception], fields: tuple[str | None, str | None] | None
) -> None:
    with harness(engine, Refusing(engine, raised)) as h:
        with pytest.raises(expected) as info:
            h.call(CheckIntegrity())
        assert type(info.value) is expected  # PinBudgetError is an InvalidRequestError: not the other way
        assert str(raised) in str(info.value)
        if fields is not None:
            got: Any = info.value
            assert (got.param, got.code) == fields  # carried as fields, not parsed from the message
        assert h.call(FlushCache()) is True


def test_the_role_gets_its_requests_and_messages_and_none_reach_the_engine(engine: Engine) -> None:
    role = Refusing(engine)
    params = SamplingParams(max_tokens=2)
    with harness(engine, role) as h:
        h.send(AddRequest(request_id="r", prompt_token_ids=[1, 2, 3], params=params))
        cancel = CancelTransfer(request_id="r", message="gone")
        h.send(cancel)
        assert h.call(FlushCache()) is True  # answered after the two messages before it
        assert role.taken == ["r"] and role.handled == [cancel]
        assert not engine.has_unfinished()


def test_without_a_role_a_refused_request_is_a_typed_request_error(engine: Engine) -> None:
    with harness(engine) as h:
        h.send(
            AddRequest(request_id="bad", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=10_000))
        )
        h.send(
            PrefillKV(
                request_id="p",
                prompt_token_ids=[1, 2, 3],
                cache_salt=None,
                priority=0,
                start=0,
                end=0,
                destination="ipc://nowhere",
            )
        )  # no role takes it: dropped, with a warning
        assert h.call(FlushCache()) is True
        [error] = [m for m in h.seen if isinstance(m, RequestError)]
        assert error.request_id == "bad" and error.error.kind == "invalid"
        assert (error.error.param, error.error.code) == ("max_tokens", "context_length_exceeded")
