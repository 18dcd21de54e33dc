"""The autoscaling policy: requests held at replicas and in gateways' queues over the target."""

from __future__ import annotations

from types import SimpleNamespace

from sendpath.cluster.autoscale import GATEWAY_QUEUED, ONGOING, desired_replicas, queue_policy


def test_desired_replicas_counts_what_replicas_hold_and_gateways_queue() -> None:
    assert desired_replicas({}, 4) == 0
    held = {ONGOING: {"r1": 4.0, "r2": 2.0}, GATEWAY_QUEUED: {"r1": 3.0, "r2": 3.0}}
    assert desired_replicas(held, 4) == 3.0  # 12 requests at 4 each
    assert desired_replicas({ONGOING: {"r1": 1.0}}, 8) == 0.125  # Serve rounds up


def test_the_policy_reads_serves_context() -> None:
    ctx = SimpleNamespace(
        config=SimpleNamespace(target_ongoing_requests=2.0),
        aggregated_metrics={ONGOING: {"r1": 5.0}, GATEWAY_QUEUED: {"r1": 1.0}},
        policy_state={"kept": 1},
    )
    assert queue_policy(ctx) == (3.0, {"kept": 1})
    ctx.aggregated_metrics = None  # no replica has reported yet
    assert queue_policy(ctx)[0] == 0
