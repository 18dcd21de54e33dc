"""`sendpath serve --ray`: replicas as a Ray Serve deployment, the gateway in this process.

``connect`` joins a Ray cluster (or starts a local instance); ``RayFleet`` deploys the
replicas (``replica.py``) as the Serve app ``APP_NAME``, placed by ``RayPlacement`` and
sized by ``RayScaling``: a fixed count, or Serve's autoscaler driven by the requests the
replicas and gateways hold (``autoscale.py``). It waits until the first replicas report
ready in the directory (``directory.py``), which the gateway then follows
(``members.py``). Closing it deletes the app; a Ray instance it started goes with it.

Serve's HTTP proxy is not started: gateways talk to each replica's own port.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from sendpath.cluster.autoscale import POLICY
from sendpath.cluster.directory import NAMESPACE, open_directory
from sendpath.cluster.replica import DRAIN_S, ServeReplica
from sendpath.config import ReplicaConfig

__all__ = ["APP_NAME", "RayFleet", "RayPlacement", "RayScaling", "connect"]

logger = logging.getLogger("sendpath.cluster")

APP_NAME = "sendpath"
DEPLOYMENT_NAME = "replica"
HEALTH_CHECK_PERIOD_S = 2.0  # Serve calls check_health this often
HEALTH_CHECK_TIMEOUT_S = 10.0
POLL_S = 0.2


def connect(address: str) -> str:
    """Join the Ray cluster at ``address``; ``auto``: the one running on this machine, or
    a new local instance when there is none. Returns what happened, for the log. Calling
    it again in a connected process does nothing.

    Ray puts a node on the machine's network address, never on loopback, unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set before Ray starts (the tests do)."""
    import ray

    if ray.is_initialized():
        return "already connected to Ray"
    if address != "auto":
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return f"joined the Ray cluster at {address}"
    try:
        ray.init(address="auto", namespace=NAMESPACE, logging_level=logging.WARNING)
        return "joined the Ray cluster running on this machine"
    except ConnectionError:
        ray.init(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING)
        return "started a local Ray instance (no cluster was running on this machine)"


@dataclass(frozen=True)
class RayPlacement:
    """What each replica asks Ray for (Ray places it on a node that has it)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("--replica-num-cpus and --replica-num-gpus must be >= 0")

    def actor_options(self) -> dict[str, Any]:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}


@dataclass(frozen=True)
class RayScaling:
    """How many replicas: ``replicas`` fixed, or between ``min_replicas`` and
    ``max_replicas`` (starting at ``replicas``) on Serve's autoscaler, aiming at
    ``target_ongoing_requests`` per replica; ``options``: more of Serve's
    ``AutoscalingConfig`` keys (delays, look-back, factors)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.min_replicas is not None and self.max_replicas is None:
            raise ValueError("--min-replicas needs --max-replicas (autoscaling)")
        if self.target_ongoing_requests <= 0:
            raise ValueError("--target-ongoing-requests must be > 0")
        if self.options and self.max_replicas is None:
            raise ValueError("--ray-autoscaling-config needs --max-replicas (autoscaling)")
        if self.max_replicas is not None:
            low = 1 if self.min_replicas is None else self.min_replicas
            if not 1 <= low <= self.max_replicas:
                raise ValueError(
                    f"need 1 <= --min-replicas <= --max-replicas, got {low} and {self.max_replicas}"
                )
            self.autoscaling_config()  # Serve's own checks, before anything starts

    @property
    def autoscales(self) -> bool:
        return self.max_replicas is not None

    @property
    def initial(self) -> int:
        """Replicas deployed at the start (and waited for)."""
        if self.max_replicas is None:
            return self.replicas
        low = 1 if self.min_replicas is None else self.min_replicas
        return min(max(self.replicas, low), self.max_replicas)

    def autoscaling_config(self) -> dict[str, Any]:
        """Serve's ``AutoscalingConfig`` (raises ValueError naming a bad key or value)."""
        from pydantic import ValidationError

        try:
            from ray.serve.config import AutoscalingConfig
        except ImportError:  # checked by the caller's require("ray"); here for the message
            raise ValueError(
                "--max-replicas needs Ray Serve: pip install 'sendpath[ray]'"
            ) from None
        known = set(AutoscalingConfig.model_fields)
        reserved = {"min_replicas", "max_replicas", "initial_replicas", "policy"}
        reserved |= {"target_ongoing_requests"}
        if bad := sorted(set(self.options) - (known - reserved)):
            raise ValueError(
                f"--ray-autoscaling-config: {', '.join(bad)} cannot be set there (unknown, "
                "or a flag of its own: --min-replicas, --max-replicas, "
                "--target-ongoing-requests)"
            )
        config = {
            **self.options,
            "min_replicas": 1 if self.min_replicas is None else self.min_replicas,
            "max_replicas": self.max_replicas,
            "initial_replicas": self.initial,
            "target_ongoing_requests": self.target_ongoing_requests,
            "policy": {"policy_function": POLICY},
        }
        try:
            AutoscalingConfig(**config)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"--ray-autoscaling-config: {where}: {first['msg']}") from None
        return config

    def serve_options(self) -> dict[str, Any]:
        if self.autoscales:
            return {"autoscaling_config": self.autoscaling_config()}
        return {"num_replicas": self.replicas}


class RayFleet:
    """The replicas as one Serve app (``start`` deploys, ``close`` deletes)."""

    def __init__(self, config: ReplicaConfig, placement: RayPlacement, scaling: RayScaling) -> None:
        self.config, self.placement, self.scaling = config, placement, scaling
        self.directory: Any = None

    def start(self, timeout_s: float) -> None:
        """Deploy and wait until ``scaling.initial`` replicas report ready (raises
        ``RuntimeError`` saying why not). Needs ``connect`` first."""
        import ray
        from ray import serve

        self.directory = open_directory()
        serve.start(proxy_location="Disabled")
        deployment = serve.deployment(
            name=DEPLOYMENT_NAME,
            ray_actor_options=self.placement.actor_options(),
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
            graceful_shutdown_timeout_s=DRAIN_S + 5.0,
            graceful_shutdown_wait_loop_s=0.5,
            **self.scaling.serve_options(),
        )(ServeReplica)
        serve._run(deployment.bind(self.config), _blocking=False, name=APP_NAME, route_prefix=None)
        deadline = time.monotonic() + timeout_s
        want = self.scaling.initial
        while True:
            app = serve.status().applications.get(APP_NAME)
            status = str(app.status) if app is not None else "NOT_STARTED"
            message = app.message if app is not None else ""
            if status.endswith("DEPLOY_FAILED"):
                why = ray.get(self.directory.last_error.remote()) or message
                raise RuntimeError(f"Ray Serve could not deploy the replicas: {why}")
            ready = [r for r in ray.get(self.directory.snapshot.remote()).replicas]
            if status.endswith("RUNNING") and sum(r.status == "ok" for r in ready) >= want:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{sum(r.status == 'ok' for r in ready)} of {want} replica(s) ready on Ray "
                    f"after {timeout_s:g} s (Serve says {status}: "
                    f"{message}); does the cluster have "
                    f"{self.placement.num_cpus:g} CPU(s) and {self.placement.num_gpus:g} "
                    "GPU(s) free per replica?"
                )
            time.sleep(POLL_S)

    def close(self) -> None:
        """Delete the app (its replicas drain and stop) and disconnect."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()
