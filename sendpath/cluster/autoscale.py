"""What drives the number of replicas on Ray Serve: requests, wherever they wait.

Serve's own autoscaler counts the requests that pass through its handles; sendpath's go
from the gateway straight to each replica's HTTP port, so Serve sees none of them. Each
replica tells it instead (``ServeReplica.record_autoscaling_stats``, every
``metrics_interval_s``):

- ``ongoing``: the requests its engine holds, running and waiting (what ``/load`` says);
- ``gateway_queued``: its share of the requests waiting in the gateways' admission queues
  (the directory's answer to its last report), which is where the excess sits once every
  replica has ``--max-inflight-per-replica`` requests.

``queue_policy`` wants ``(sum of ongoing + sum of gateway_queued) / target_ongoing_requests``
replicas. Serve applies the rest of the ``AutoscalingConfig`` around it, as for its own
policy: the averaging over ``look_back_period_s``, ``upscale_delay_s`` /
``downscale_delay_s``, the scaling factors, and ``min_replicas`` / ``max_replicas``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["POLICY", "desired_replicas", "queue_policy"]

POLICY = "sendpath.cluster.autoscale:queue_policy"  # what the deployment's config names
ONGOING, GATEWAY_QUEUED = "ongoing", "gateway_queued"


def desired_replicas(metrics: dict[str, dict[Any, float]], target: float) -> float:
    """Replicas wanted for the replicas' reported ``metrics`` (name -> replica -> value)."""
    waiting = sum(metrics.get(ONGOING, {}).values()) + sum(metrics.get(GATEWAY_QUEUED, {}).values())
    return waiting / target


def queue_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's custom policy hook (``ctx``: its ``AutoscalingContext``)."""
    target = ctx.config.target_ongoing_requests or 1.0
    metrics = ctx.aggregated_metrics or {}
    return desired_replicas(metrics, target), ctx.policy_state
