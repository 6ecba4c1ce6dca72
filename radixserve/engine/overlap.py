"""The overlapped loop: step N+1 is scheduled and launched before step N's tokens are read.

A step of the plain loop (``Engine.step``) reads its sampled tokens back to the host before the next
step is scheduled, so the device waits while the host appends tokens, checks stops, makes text and
builds outputs. Here each step does, in order:

1. take in new requests and aborts; schedule step N+1;
2. launch step N+1. A request sampled at step N has a ``PENDING`` token last in its ``token_ids``
   (``model/pending.py``), so the scheduler gives it its slot; the model takes that token from step N's
   sampled tokens on the device (``Pending``), never from the host;
3. read step N's tokens (the one read-back, a step late: on CUDA the device runs N+1 meanwhile) and
   advance each request as the plain loop does (``Engine._advance``): tokens, stops, text, outputs;
4. count what step N+1 computed and sample its rows on the device (``Engine._postprocess``,
   ``overlapped``): their tokens wait, as ``InFlight``, for the next step's read.

Tokens are the plain loop's, because each input of a step is what the plain loop would give it: a
row's logits come from the same tokens and K/V; its sampling (step 4) runs after step N was read, so
penalties see step N's token and a grammar mask is built from a matcher that has accepted it.

**A request that finishes at step N.** When its last token is known in advance (``max_tokens``, which
also bounds the context), no ``PENDING`` is appended: it has nothing to compute, the scheduler passes
it over, and it ends when its token is read. Otherwise (EOS, a stop token or string, a complete
grammar) it is known only at the read, after step N+1 was launched with its row: that row's K/V goes to
the request's own slot, freed with its pages when it finishes, and its logits are never sampled
(``Engine._postprocess`` skips finished requests). The cost is one row of step N+1 for each such
request. A jump-forward grammar's forced tokens work the same way: the row computed for the sampled
token is kept, its logits are not sampled, and the forced tokens are computed as one chunk at N+2.

Not with speculative decoding (drafts are made from the very token not yet read) nor tensor
parallelism (the workers take token ids from rank 0's host): ``engine/builder.py::overlapped``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.engine.next_tokens import Sampled
from radixserve.engine.request import Request, Status
from radixserve.model.pending import PENDING, Pending
from radixserve.sampling.grammar import Matcher

if TYPE_CHECKING:
    from radixserve.engine.next_tokens import Picked
    from radixserve.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class InFlight:
    """A step whose tokens were sampled on the device and not read yet: row i is ``reqs[i]``'s."""

    reqs: list[Request]
    matchers: list[Matcher | None]
    sampled: Sampled


def defer(reqs: list[Request], matchers: list[Matcher | None], sampled: Sampled) -> InFlight:
    """Keep a step's sampled tokens for the next step's read. Each request gets a ``PENDING`` token
    last, the slot the next step computes, unless the token is its last (``max_tokens``)."""
    for r in reqs:
        if r.num_output_tokens + 1 < r.params.max_tokens:
            r.token_ids.append(PENDING)
    return InFlight(reqs, matchers, sampled)


def pending_inputs(batch: ScheduledBatch, prev: InFlight) -> Pending | None:
    """Which chunks of ``batch`` end at a token of ``prev`` (a request sampled in the previous step, as
    a decode row, or a prefill after a preemption), and where that token is."""
    chunks: list[int] = []
    rows: list[int] = []
    row_of: dict[int, int] | None = None
    for j, (r, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        ids = r.token_ids
        if ids[-1] == PENDING and r.num_computed_tokens + n == len(ids):
            if row_of is None:
                row_of = {id(q): i for i, q in enumerate(prev.reqs)}
            chunks.append(j)
            rows.append(row_of[id(r)])
    return Pending(prev.sampled.out.tokens, chunks, rows) if chunks else None


def read(prev: InFlight) -> tuple[list[Request], list[Matcher | None], list[Picked]]:
    """Step N's tokens on the host (the one read-back), each taking its request's ``PENDING`` place;
    returns what ``Engine._advance`` takes. A request that ended meanwhile (an abort) takes none."""
    picks = prev.sampled.read()
    reqs, matchers = prev.reqs, prev.matchers
    if any(r.status is Status.FINISHED for r in reqs):
        live = [i for i, r in enumerate(reqs) if r.status is not Status.FINISHED]
        reqs, matchers, picks = [reqs[i] for i in live], [matchers[i] for i in live], [picks[i] for i in live]
    for r in reqs:
        if r.token_ids[-1] == PENDING:
            r.token_ids.pop()
    return reqs, matchers, picks
