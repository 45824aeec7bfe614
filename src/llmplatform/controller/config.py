"""The controller's settings (frozen, validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmplatform.controller.registry import DEFAULT_HEARTBEAT_EXPIRATION_S
from llmplatform.protocol.lifecycle import LaunchModelRequest
from llmplatform.routing.cache_aware import CacheAwareConfig
from llmplatform.routing.policies import DEFAULT_DISPATCH_METHOD, DispatchMethod
from llmplatform.utils.request_guard import RequestGuardConfig
from llmplatform.utils.worker_addresses import parse_networks


@dataclass(frozen=True)
class ControllerConfig:
    """Controller settings; validated at construction."""

    dispatch_method: DispatchMethod = DEFAULT_DISPATCH_METHOD
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    """cache_aware's knobs (used when it is the dispatch method)."""
    heartbeat_expiration: float = DEFAULT_HEARTBEAT_EXPIRATION_S
    """Seconds without a heartbeat after which a worker is dropped. Our workers beat every ~3 s;
    quieter ones (stock FastChat workers beat every 45 s) are polled before they would expire."""
    expiry_interval: float | None = None
    """Seconds between expiry sweeps; None means heartbeat_expiration / 3."""
    status_timeout: float = 5.0
    """Seconds allowed for one `/worker_get_status` poll of a worker."""
    connect_timeout: float = 5.0
    """Seconds allowed to connect to a worker."""
    stream_read_timeout: float = 100.0
    """Max seconds of silence inside a proxied stream (long prefills); FastChat uses 100."""
    cluster_secret: str | None = None
    """When set, every route but /health, /metrics and /test_connection needs it in the
    X-LLMPlatform-Secret header, and the controller sends it to workers."""
    allowed_worker_networks: tuple[Any, ...] = ()
    """CIDR networks (strings or `ipaddress` networks) every address a worker's URL reaches must
    lie in; empty: any address but bind-all, multicast, link-local, broadcast and cloud metadata
    endpoints (see `admission`)."""
    confirm_timeout: float = 30.0
    """Seconds a registration whose address does not accept connections yet (a stock FastChat
    worker registers before it listens) waits for it to answer; never routed meanwhile, dropped
    after (see `confirmation`)."""
    model_load_timeout: float = 600.0
    """Seconds a launched model's workers have to register before it is failed (and stopped)."""
    agent_timeout: float = 30.0
    """Seconds allowed for a host agent's answer (a launch is answered once its checks pass)."""
    agent_stop_timeout: float = 300.0
    """Seconds a stopped worker's agent may take to answer (the worker drains meanwhile)."""
    on_demand_models: tuple[LaunchModelRequest, ...] = ()
    """Models registered as launchable from the start (each started by its first request)."""
    guard: RequestGuardConfig = RequestGuardConfig()
    """What a request must be to reach a route: Host, Origin, JSON body, body size (see
    `request_guard`); `__main__` sets the allowed hosts from the bind address."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dispatch_method", DispatchMethod(self.dispatch_method))
        object.__setattr__(
            self, "allowed_worker_networks", parse_networks(str(n) for n in self.allowed_worker_networks)
        )
        if self.cluster_secret is not None and not self.cluster_secret.strip():
            raise ValueError("cluster_secret must not be empty (use None for no secret)")
        positive = {
            "heartbeat_expiration": self.heartbeat_expiration,
            "status_timeout": self.status_timeout,
            "connect_timeout": self.connect_timeout,
            "stream_read_timeout": self.stream_read_timeout,
            "confirm_timeout": self.confirm_timeout,
            "model_load_timeout": self.model_load_timeout,
            "agent_timeout": self.agent_timeout,
            "agent_stop_timeout": self.agent_stop_timeout,
        }
        if self.expiry_interval is not None:
            positive["expiry_interval"] = self.expiry_interval
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")

    @property
    def effective_expiry_interval(self) -> float:
        if self.expiry_interval is not None:
            return self.expiry_interval
        return self.heartbeat_expiration / 3
