"""Decode headroom (issue 59): a decode engine whose reservations wait on a saturated prefill engine,
with the headroom rule and without it (reserving whenever pages can be had, the rule before).

    python -m benchmarks.scale.decode_headroom_bench [--quick]

One process, the two roles of ``--disaggregate 1:1`` on two engines of the embedded model
(SmolLM2-135M, page 16). Requests arrive one every ``--arrive-every`` loops (prompts of ~112 distinct
tokens, 7 pages to transfer as in the soak's reservations, and 96 output tokens each) at a decode
engine of ``--decode-pages`` pages; the decode engine steps every loop, the prefill engine once every
``--prefill-every`` loops with ``--prefill-chunk`` tokens a step, so it is the bottleneck and
reservations wait on it, as in the soak at twice its capacity. Per decode step it records whether the
step made a token for any request the decode engine had while reservations held pages; a step that
made none is a starved step. Reported: wall time, decode steps, starved steps and the longest starved
stretch (steps and seconds), preemptions, requests computed on the decode engine (``ROOM_WAIT_S`` is
lifted: the run is paced in loops, not seconds), the most pages reservations held, output tokens per
second, and how many requests finished within ``--max-steps`` decode steps.
Results: benchmarks/results/decode_headroom_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import zmq

from benchmarks.lib.common import write_results
from radixserve.disagg import decode as decode_module
from radixserve.disagg.decode import DecodeRole
from radixserve.disagg.prefill import PrefillRole
from radixserve.disagg.transport import KVReceiver, KVSender
from radixserve.engine.engine import Engine
from radixserve.model.default_model import prepare_default_model
from radixserve.runtime.messages import AddRequest, FromEngine, KVReserved, PrefillKV
from radixserve.sampling.params import SamplingParams

PAGE = 16


def _prompts(n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(tokens + rng.randrange(-20, 21))] for _ in range(n)]


def run(model: Path, headroom: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One burst through both roles; the decode engine's starvation figures."""
    prefill = Engine(  # a slow prefill engine: small steps, and only every few loops
        str(model), page_size=PAGE, num_pages=2048, enforce_eager=True, max_batched_tokens=args.prefill_chunk
    )
    decode = Engine(str(model), page_size=PAGE, num_pages=args.decode_pages, enforce_eager=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sent: list[FromEngine] = []
    reserved_ids: set[str] = set()

    def add(msg: AddRequest, arrived: float) -> bool:
        decode.add_request(msg.prompt_token_ids, msg.params, msg.request_id, arrival_time=arrived)
        return True

    p_role = PrefillRole(prefill, sent.append, KVSender(ctx))
    d_role = DecodeRole(decode, sent.append, add, KVReceiver(ctx, "shm"), timeout_s=600.0)
    saved, saved_wait = decode_module.room_to_reserve, decode_module.ROOM_WAIT_S
    decode_module.ROOM_WAIT_S = 1e9  # no fallback by the clock: the run is counted in loops, not seconds
    if not headroom:  # the rule before: reserve whenever the pages can be had
        decode_module.room_to_reserve = lambda *a, **k: True  # type: ignore[assignment]
        setattr(d_role, "_add", d_role._add_to_engine)  # noqa: B010 (no wait for the next step either)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(args.requests, args.prompt_tokens)
    tokens: dict[str, int] = {}
    starved, stretch, longest, steps, loops, peak_reserved = 0, 0.0, 0.0, 0, 0, 0
    run_steps, longest_steps = 0, 0
    start = time.monotonic()
    try:
        arrived, done_at = 0, 0
        while sum(tokens.values()) < args.requests * args.max_tokens and steps < args.max_steps:
            if arrived < len(prompts) and loops % args.arrive_every == 0:
                new = AddRequest(request_id=f"r{arrived}", prompt_token_ids=prompts[arrived], params=params)
                d_role.add_request(new)
                arrived += 1
            for msg in sent[done_at:]:
                if isinstance(msg, KVReserved):
                    reserved_ids.add(msg.request_id)
                    prompt = prompts[int(msg.request_id[1:])]
                    job = PrefillKV(
                        request_id=msg.request_id,
                        prompt_token_ids=prompt[: msg.end + 1],
                        cache_salt=None,
                        priority=0,
                        start=msg.start,
                        end=msg.end,
                        destination=msg.address,
                    )
                    p_role.handle(job)
            done_at = len(sent)
            d_role.poll()
            loops += 1
            if loops % args.prefill_every == 0 and prefill.has_unfinished():
                p_role.after_step(prefill.step())
            if not decode.has_unfinished():
                continue
            here = len(decode.scheduler.running) + len(decode.scheduler.waiting)
            held = sum(len(r.pages.table) - r.start // PAGE for r in d_role.reservations.values())
            peak_reserved = max(peak_reserved, held)
            t0 = time.monotonic()
            outputs = d_role.after_step(decode.step())
            took = time.monotonic() - t0
            steps += 1
            made = [o for o in outputs if o.token_ids]
            for o in made:
                tokens[o.group_id] = tokens.get(o.group_id, 0) + len(o.token_ids)
            if here and not made and d_role.reservations:
                starved += 1
                stretch += took
                run_steps += 1
                longest, longest_steps = max(longest, stretch), max(longest_steps, run_steps)
            else:
                stretch, run_steps = 0.0, 0
            d_role.check_integrity()
    finally:
        decode_module.room_to_reserve, decode_module.ROOM_WAIT_S = saved, saved_wait
        d_role.close()
        p_role.close()
        ctx.destroy(linger=0)
    wall = time.monotonic() - start
    kv = decode.kv_manager
    assert kv.num_free + kv.num_cached + kv.num_in_use == kv.num_pages
    return {
        "rule": "headroom" if headroom else "reserve when free (before)",
        "wall_s": round(wall, 2),
        "decode_steps": steps,
        "starved_steps": starved,
        "longest_starved_steps": longest_steps,
        "longest_starved_s": round(longest, 3),
        "preemptions": decode.scheduler.num_preemptions,
        "computed_on_decode": args.requests - len(reserved_ids),
        "peak_reserved_pages": peak_reserved,
        "finished": sum(n >= args.max_tokens for n in tokens.values()),
        "output_tokens_per_s": round(sum(tokens.values()) / wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=112)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--decode-pages", type=int, default=96)
    parser.add_argument("--arrive-every", type=int, default=2, help="a request arrives every N loops")
    parser.add_argument("--prefill-every", type=int, default=4, help="the prefill engine steps every N loops")
    parser.add_argument("--prefill-chunk", type=int, default=112, help="prompt tokens a prefill step")
    parser.add_argument("--max-steps", type=int, default=1000, help="decode steps before giving up")
    parser.add_argument("--quick", action="store_true", help="12 requests of 64 tokens, 64 pages")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.decode_pages, args.max_steps = 12, 64, 64, 300
    model = prepare_default_model(progress=False)
    rows = [run(model, headroom, args) for headroom in (False, True)]
    for row in rows:
        print(row)
    header = list(rows[0])
    write_results(
        "decode_headroom_bench",
        {"args": vars(args), "rows": rows},
        [[row[k] for k in header] for row in rows],
        header,
        "Decode headroom: reservations waiting on a saturated prefill engine",
    )


if __name__ == "__main__":
    main()
