"""Autoscaling and warm start without Ray: the scaling decision, the policy Ray calls, the flags, the
replica's queue-wait window and the hot-prefix table (docs/scaling.md)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from radixserve.cache.events import KVEvent, KVEvents
from radixserve.cache.tiers import namespace_key, page_key
from radixserve.cli import main
from radixserve.runtime.backend import RequestRecord
from radixserve.scale import autoscale
from radixserve.scale.autoscale import AutoscaleSettings, QueueWaitPolicy, QueueWaits, ReplicaLoad
from radixserve.scale.cache_index import CacheIndex
from radixserve.scale.remote_engine import rebased
from radixserve.scale.warm_start import HotPrefixes

WAIT, DEPTH = 2.0, 8.0


def desired(current: int, loads: list[ReplicaLoad], queued: float = 0.0) -> int:
    return autoscale.desired_replicas(current, loads, queued, WAIT, DEPTH)


def test_a_long_queue_wait_or_a_deep_queue_scales_up_and_a_quiet_one_down() -> None:
    busy = ReplicaLoad(queue_wait_p95_s=0.1, queue_depth=2, running=4, capacity=4)
    assert desired(1, [busy]) == 1  # some queue, short waits: hold
    assert desired(1, [ReplicaLoad(queue_wait_p95_s=2.5, queue_depth=1, running=4, capacity=4)]) == 2
    # 30 waiting (engines and Serve's queue) at 8 per replica: 4 replicas, not just one more.
    assert desired(1, [ReplicaLoad(queue_depth=10, running=4, capacity=4)], queued=20) == 4
    idle = ReplicaLoad(queue_wait_p95_s=0.0, queue_depth=0, running=0, capacity=4)
    assert desired(2, [idle, idle]) == 1
    assert desired(1, [idle]) == 1  # never below one
    # Nothing waits, but the running requests would fill more than half of one replica: hold at 2.
    half = ReplicaLoad(queue_wait_p95_s=0.0, queue_depth=0, running=2, capacity=4)
    assert desired(2, [half, half]) == 2
    # A wait just under the target is not quiet enough to step down.
    assert desired(2, [ReplicaLoad(queue_wait_p95_s=1.0, capacity=4), idle]) == 2
    assert desired(3, []) == 3  # nothing reported yet: hold


@dataclass
class FakeContext:
    """The fields of Ray Serve's AutoscalingContext that the policy reads."""

    current_num_replicas: int
    running_replicas: list[str]
    aggregated_metrics: dict[str, dict[str, float]]
    total_queued_requests: float = 0.0
    policy_state: dict[str, Any] = field(default_factory=dict)


def test_the_ray_policy_reads_each_replicas_reported_figures() -> None:
    policy = QueueWaitPolicy(target_queue_wait_s=WAIT, target_queue_depth=DEPTH)
    m = {
        autoscale.QUEUE_WAIT_P95: {"a": 3.0, "b": 0.0},
        autoscale.QUEUE_DEPTH: {"a": 5.0, "b": 0.0},
        autoscale.RUNNING: {"a": 4.0, "b": 0.0},
        autoscale.CAPACITY: {"a": 4.0, "b": 4.0},
    }
    n, state = policy(FakeContext(2, ["a", "b"], m, policy_state={"x": 1}))
    assert n == 3 and state == {"x": 1}
    quiet = {k: {"a": 0.0, "b": 0.0} for k in m} | {autoscale.CAPACITY: {"a": 4.0, "b": 4.0}}
    assert policy(FakeContext(2, ["a", "b"], quiet))[0] == 1
    # Serve's own queue counts: 20 held requests at 8 per replica ask for 3.
    assert policy(FakeContext(1, ["a"], quiet, total_queued_requests=20.0))[0] == 3
    # A replica that has not reported yet (just started) is left out, not read as idle.
    assert policy(FakeContext(2, ["a", "c"], {k: {"a": v["a"]} for k, v in m.items()}))[0] == 3


def test_the_settings_become_rays_autoscaling_config_with_our_policy() -> None:
    AutoscalingConfig = pytest.importorskip("ray.serve.config").AutoscalingConfig

    s = AutoscaleSettings(min_replicas=1, max_replicas=3, upscale_delay_s=5, downscale_delay_s=60)
    config = AutoscalingConfig(**s.ray_config())  # Ray's own validation accepts it
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 3, 1)
    assert (config.upscale_delay_s, config.downscale_delay_s) == (5, 60)
    assert config.policy.policy_function == "radixserve.scale.autoscale:QueueWaitPolicy"
    assert AutoscaleSettings().downscale_delay_s == 600  # the guide's ten minutes of low load
    assert AutoscaleSettings.from_dict(s.as_dict()) == s
    with pytest.raises(ValueError, match="unknown autoscale settings"):
        AutoscaleSettings.from_dict({"min_replica": 1})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--min-replicas", "3", "--max-replicas", "2"],
            r"--min-replicas \(3\) must not exceed --max-replicas",
        ),
        (["--upscale-delay-s", "-1"], "--upscale-delay-s must be >= 0"),
        (["--downscale-delay-s", "-5"], "--downscale-delay-s must be >= 0"),
        (["--min-replicas", "0"], "--min-replicas must be >= 1"),
        (["--target-queue-wait-s", "0"], "--target-queue-wait-s must be > 0"),
    ],
)
def test_bad_autoscaling_flags_get_an_error_naming_them(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):  # before Ray or any engine starts
        main(["serve", "--replicas", "auto", *flags])


def test_autoscaling_flags_without_auto_and_auto_without_ray_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(SystemExit, match="--min-replicas, --max-replicas need --replicas auto"):
        main(["serve", "--min-replicas", "1", "--max-replicas", "2"])
    with pytest.raises(SystemExit, match="--replicas must be >= 1 or auto, got 0"):
        main(["serve", "--replicas", "0"])
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--replicas", "some"])
    assert exc.value.code == 2  # argparse: "--replicas takes a count or 'auto'"
    monkeypatch.setitem(sys.modules, "ray", None)  # an import of ray now raises ImportError
    with pytest.raises(SystemExit, match=r"--replicas auto \(or more than 1\) needs Ray Serve"):
        main(["serve", "--replicas", "auto"])
    with pytest.raises(SystemExit, match="needs Ray Serve"):
        main(["ray-deploy", "--address", "auto", "--replicas", "auto", "--max-replicas", "3"])


def test_the_queue_wait_p95_counts_finished_waits_in_its_window_and_requests_still_waiting() -> None:
    waits = QueueWaits(window_s=10.0)
    assert waits.p95(0.0) == 0.0
    for i in range(20):
        waits.add(float(i) / 10, 0.1)
    waits.add(2.0, 3.0)  # one long wait among 21: above the 95th percentile's rank
    assert waits.p95(2.0) == 0.1
    waits.add(2.0, 3.0)
    assert waits.p95(2.0) == 3.0
    assert waits.p95(11.5) == 3.0  # the 0.1 s waits of t < 1.5 left the window
    assert waits.p95(13.0) == 0.0  # and then the long ones
    assert waits.p95(13.0, waiting_ages=[4.0]) == 4.0  # a request still waiting 4 s counts as 4 s


def test_hot_prefixes_rank_by_reuse_and_skip_a_prefix_of_a_chosen_one() -> None:
    hot = HotPrefixes(max_entries=4)  # kept: at most 5, then the coldest go down to 4
    doc_a, doc_b = list(range(8)), list(range(100, 104))
    for _ in range(3):
        hot.record(doc_a, None)
    hot.record(doc_a[:4], None)  # a prefix of doc_a: warming doc_a caches it too
    hot.record(doc_a[:4], None)
    hot.record(doc_a[:4], None)
    hot.record(doc_a[:4], None)
    hot.record(doc_b, None)
    hot.record(doc_b, None)
    hot.record(doc_a, "tenant")  # another namespace: another prefix
    hot.record([7, 7, 7, 7], None)  # a fifth prefix: still kept
    hot.record([8, 8, 8, 8], None)  # a sixth: the two least counted go (of equals, the shorter)
    # doc_a[:4] is the most reused, but doc_a covers it: doc_a takes its rank (and its count).
    top = hot.hottest(3)
    assert [(p.token_ids, p.cache_salt, p.hits) for p in top] == [
        (doc_a, None, 4),
        (doc_b, None, 2),
        (doc_a, "tenant", 1),
    ]
    assert [p.token_ids for p in hot.hottest(1)] == [doc_a[:4]]  # with one slot, the most reused
    assert len(hot._counts) == 4  # bounded: the least counted went
    hot.record([], None)
    assert all(p.token_ids for p in hot.hottest(10))


def test_a_prefix_ranks_after_a_longer_one_it_starts_when_both_are_hot() -> None:
    hot = HotPrefixes()
    doc = list(range(12))
    for _ in range(2):
        hot.record(doc, None)
        hot.record(doc[:8], None)
    assert [p.token_ids for p in hot.hottest(5)] == [doc]  # the longer first; its prefix is covered


def test_the_cache_index_remembers_the_prefixes_its_scores_found_reused() -> None:
    ps, seed = 4, b"seed"
    index = CacheIndex()
    doc = list(range(10, 22))  # 3 pages
    keys, key = [], namespace_key(seed, None)
    for start in range(0, 12, ps):
        key = page_key(key, doc[start : start + ps])
        keys.append(key)
    index.register("a")
    index.apply("a", [KVEvents(seed=seed, page_size=ps, events=[KVEvent(kind="stored", keys=keys[:2])])])
    assert index.hottest(4) == []
    index.score(doc + [99, 98], None)  # two pages held: those are the reused prefix
    index.score(list(range(50, 60)), None)  # nothing held: no reuse, nothing remembered
    [hot] = index.hottest(4)
    assert hot.token_ids == doc[:8] and hot.cache_salt is None and hot.hits == 1


def test_a_new_replica_warms_every_pinned_prefix_first_then_the_hottest() -> None:
    ps, seed = 4, b"seed"
    index = CacheIndex()
    hot_doc, pinned_doc = list(range(10, 22)), list(range(100, 116))
    keys, key = [], namespace_key(seed, None)
    for start in range(0, 12, ps):
        key = page_key(key, hot_doc[start : start + ps])
        keys.append(key)
    index.register("a")
    index.apply("a", [KVEvents(seed=seed, page_size=ps, events=[KVEvent(kind="stored", keys=keys)])])
    for _ in range(3):
        index.score(hot_doc, None)
    index.register("b")
    index.set_pins("b", {"p1": ("key:t", pinned_doc), "p2": ("key:t", pinned_doc[:8])})  # never scored
    first, second = index.hottest(2)
    # The pinned prefix (its shorter pin covered by it) before the one scored three times.
    assert (first.cache_salt, first.token_ids) == ("key:t", pinned_doc)
    assert (second.cache_salt, second.token_ids) == (None, hot_doc)
    assert [p.token_ids for p in index.hottest(1)] == [pinned_doc]
    index.set_pins("b", {})  # its pins expired or were deleted: no longer a source
    assert [p.token_ids for p in index.hottest(2)] == [hot_doc]


def test_a_record_is_rebased_onto_the_ingress_so_serves_queue_counts_as_queue_time() -> None:
    rec = RequestRecord(
        request_id="r",
        prompt_tokens=4,
        cached_tokens=0,
        output_tokens=2,
        finish_reason="length",
        arrival_time=100.0,
        scheduled_time=100.5,
        first_token_time=100.7,
        finish_time=101.0,
        token_gaps=[0.3],
    )
    moved = rebased(rec, 1.5)
    assert moved.queue_time == pytest.approx(2.0) and moved.ttft == pytest.approx(2.2)
    assert rebased(rec, -0.01).queue_time == pytest.approx(0.5)  # clock noise never shortens it
