"""radixserve/topology.py: one choice of layout from the flags, for ``serve`` and ``ray-deploy`` alike."""

from __future__ import annotations

import pytest

from radixserve.cli import build_parser
from radixserve.topology import pick_layout


def _layout(*argv: str, cluster: bool = False) -> str:
    return pick_layout(build_parser().parse_args(list(argv)), on_cluster=cluster)


def test_each_layout_from_its_flags() -> None:
    assert _layout("serve") == "single"
    assert _layout("serve", "--replicas", "1") == "single"
    assert _layout("serve", "--disaggregate", "1:1") == "disaggregated"
    assert _layout("serve", "--replicas", "2") == "replicas"
    assert _layout("serve", "--replicas", "auto", "--max-replicas", "3") == "replicas"
    assert _layout("serve", "--prefill-replicas", "1", "--decode-replicas", "2") == "disaggregated_replicas"
    # ray-deploy: the same choice, on a cluster (its default is two replicas)
    assert _layout("ray-deploy", "--address", "auto", cluster=True) == "replicas"
    assert _layout("ray-deploy", "--address", "auto", "--replicas", "1", cluster=True) == "replicas"
    deploy = ("ray-deploy", "--address", "auto", "--prefill-replicas", "1", "--decode-replicas", "1")
    assert _layout(*deploy, cluster=True) == "disaggregated_replicas"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--disaggregate", "1:1", "--prefill-replicas", "1", "--decode-replicas", "1"), "exclude"),
        (("--prefill-replicas", "1"), "must both be >= 1"),
        (("--disaggregate", "1:1", "--replicas", "2"), "--prefill-replicas and --decode-replicas"),
        (("--disaggregate", "1:1", "--engine-cpus", "0"), "--engine-cpus pins one engine process"),
        (("--max-replicas", "3"), "need --replicas auto"),
        (("--replicas", "0"), "--replicas must be >= 1"),
    ],
)
def test_flags_of_layouts_that_exclude_each_other_are_refused(argv: tuple[str, ...], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _layout("serve", *argv)
