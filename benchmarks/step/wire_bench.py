"""The cost of keyed wire structs: a typical ``StepReport`` message, array-like (as sent) vs keyed.

Issue 22 asked to either build every array-like struct by keyword (what was done: ``kw_only`` plus
``tests/test_wire_structs.py``) or make the wire format keyed (field names on the wire, so order no
longer matters). This times msgpack encode and decode of one step's message both ways: the structs as
they are, and copies of them declared without ``array_like`` (same fields, same defaults).

    python -m benchmarks.step.wire_bench [--batch 8] [--repeats 2000]

Prints a table; writes benchmarks/results/wire_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import timeit
from typing import Any

import msgspec

from benchmarks.lib.common import write_results
from radixserve.cache.events import KVEvents
from radixserve.engine.deltas import StepOutput
from radixserve.engine.stats import EngineStats
from radixserve.outputs import TokenLogprob


def keyed(cls: type[msgspec.Struct], **replace: Any) -> type[msgspec.Struct]:
    """``cls`` declared again as a keyed (map) struct: the same fields and defaults, names on the wire."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(cls):
        tp = replace.get(f.name, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, tp, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, tp, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, tp))
    return msgspec.defstruct(cls.__name__, fields, kw_only=True, tag=cls.__struct_config__.tag)


class _Outputs(msgspec.Struct, tag="StepReport", array_like=True, kw_only=True):
    """``server.messages.StepReport``' fields (that module imports the server; this stays light)."""

    time: float
    outputs: list[StepOutput]
    scheduled: list[str]
    stats: EngineStats
    kv_events: KVEvents | None = None


def typical_step(batch: int, struct: type, step: type, stats: type) -> Any:
    """A decode step of ``batch`` requests, one token each, with the counters the engine sends."""
    outs = [
        step(
            group_id=f"{i:032x}",
            index=0,
            token_ids=[1234 + i],
            text=None,
            logprobs=None,
            finish_reason=None,
            stop_reason=None,
            cached_tokens=512,
            time=123.456,
        )
        for i in range(batch)
    ]
    tiers = {"device": {k: 1.0 for k in ("hits", "evicted", "used_bytes", "capacity_bytes", "loads")}}
    s = stats(
        num_running=batch, num_pages=4096, free_pages=1000, cached_pages=3000, num_steps=99, tiers=tiers
    )
    return struct(time=123.456, outputs=outs, scheduled=[], stats=s)


def measure(batch: int, repeats: int) -> list[dict[str, Any]]:
    keyed_step = keyed(StepOutput, logprobs=list[TokenLogprob] | None)
    keyed_stats = keyed(EngineStats)
    keyed_outputs = keyed(_Outputs, outputs=list[keyed_step], stats=keyed_stats)  # type: ignore[valid-type]
    rows = []
    for name, msg, cls in (
        ("array-like", typical_step(batch, _Outputs, StepOutput, EngineStats), _Outputs),
        ("keyed", typical_step(batch, keyed_outputs, keyed_step, keyed_stats), keyed_outputs),
    ):
        enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(cls)
        data = enc.encode(msg)
        assert dec.decode(data) == msg
        best = {
            what: min(timeit.repeat(stmt, number=repeats, repeat=5, globals=env)) / repeats * 1e6
            for what, stmt in (("encode", "enc.encode(msg)"), ("decode", "dec.decode(data)"))
            for env in [{"enc": enc, "dec": dec, "msg": msg, "data": data}]
        }
        rows.append(
            {
                "format": name,
                "batch": batch,
                "bytes": len(data),
                "encode_us": best["encode"],
                "decode_us": best["decode"],
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description="array-like vs keyed StepReport: msgpack encode/decode time")
    p.add_argument("--batch", default="1,8,32", help="requests per step, comma-separated")
    p.add_argument("--repeats", type=int, default=2000)
    args = p.parse_args()
    rows = [r for b in args.batch.split(",") for r in measure(int(b), args.repeats)]
    header = ["format", "batch", "bytes", "encode (us)", "decode (us)"]
    table = [
        [r["format"], r["batch"], r["bytes"], f"{r['encode_us']:.2f}", f"{r['decode_us']:.2f}"] for r in rows
    ]
    for line in [header, *table]:
        print(" | ".join(str(x) for x in line))
    write_results("wire_bench", {"rows": rows}, table, header, "StepReport on the wire: array-like vs keyed")


if __name__ == "__main__":
    main()
