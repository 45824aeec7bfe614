"""`python -m llmplatform.controller`: read the settings, build the app, serve it (graceful SIGTERM).

`ControllerServiceSettings` declares every flag (and so every `LLMPLATFORM_*` variable and
cluster-file key, `utils/settings.py`); `main(argv)` is public so `llmplatform controller ...`
can reuse it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from llmplatform.controller.app import create_app
from llmplatform.controller.config import ControllerConfig
from llmplatform.controller.registry import DEFAULT_HEARTBEAT_EXPIRATION_S
from llmplatform.protocol.lifecycle import LaunchModelRequest
from llmplatform.routing.cache_aware import CacheAwareConfig
from llmplatform.routing.policies import DEFAULT_DISPATCH_METHOD, DispatchMethod
from llmplatform.utils.cluster_secret import SECRET_HEADER
from llmplatform.utils.logs import configure_logging, log_summary
from llmplatform.utils.server import DEFAULT_SHUTDOWN_TIMEOUT_S
from llmplatform.utils.service_settings import ServerSettings
from llmplatform.utils.settings import CommaList, OptionalText, option
from llmplatform.utils.startup import listen_url

DEFAULT_PORT = 21001


class ControllerServiceSettings(ServerSettings):
    cli_prog = "python -m llmplatform.controller"
    cli_description = "Run the llmplatform controller (FastChat-compatible worker registry)."
    sections = ("controller_config",)

    port: int = option(DEFAULT_PORT, "bind port; 0 picks a free one (default: %(default)s)")
    dispatch_method: DispatchMethod = option(
        DEFAULT_DISPATCH_METHOD, "how to choose among workers serving a model: cache_aware (the "
        "worker most likely to hold the prompt's prefix in its prefix cache, or the session's "
        "worker, within a balance threshold of the least loaded; least_load among workers "
        "without a prefix cache), least_load (share of batch capacity in use, avoiding full KV "
        "caches), shortest_queue (FastChat's queue_length/speed) or lottery (random, weighted "
        "by speed) (default: %(default)s)")
    cache_aware_balance_threshold: int = option(
        CacheAwareConfig.balance_threshold, "cache_aware: outstanding requests the worker holding "
        "a hot prefix (more than one worker's share of the recent requests) or the session may "
        "have beyond the least loaded worker before load decides instead (default: %(default)s)",
        metavar="REQUESTS", ge=0)
    cache_aware_cold_balance_threshold: int = option(
        CacheAwareConfig.cold_balance_threshold, "cache_aware: outstanding requests the worker "
        "holding a cold prefix (at most one worker's share of the recent requests) may have beyond "
        "the least loaded worker before load decides instead; moving it computes it again "
        "elsewhere (default: %(default)s)", metavar="REQUESTS", ge=0)
    cache_aware_heat_half_life: float = option(
        CacheAwareConfig.heat_half_life, "cache_aware: the request counts that tell hot prefixes "
        "from cold ones halve every this many requests per worker of the model (default: "
        "%(default)s)", metavar="REQUESTS", gt=0)
    cache_aware_entry_ttl: float = option(
        CacheAwareConfig.entry_ttl_s, "cache_aware: seconds after it was last routed that a "
        "prefix or a session is forgotten (default: %(default)s)", metavar="SECONDS", gt=0)
    cache_aware_max_chunks_per_worker: int = option(
        CacheAwareConfig.max_chunks_per_worker, "cache_aware: prompt chunks (64 characters each) "
        "remembered per worker, least recently routed dropped first (default: %(default)s)",
        metavar="N", ge=1)
    cache_aware_max_sessions: int = option(
        CacheAwareConfig.max_sessions, "cache_aware: sessions remembered in all (default: "
        "%(default)s)", metavar="N", ge=1)
    heartbeat_expiration: float = option(
        DEFAULT_HEARTBEAT_EXPIRATION_S, "drop a worker after this long without a heartbeat "
        "(default: %(default)s)", metavar="SECONDS")
    shutdown_timeout: float = option(
        DEFAULT_SHUTDOWN_TIMEOUT_S, "on SIGTERM: stop accepting, "
        "let in-flight requests (proxied streams) run this long, then exit (default: "
        "%(default)s)", metavar="SECONDS", gt=0)
    cluster_secret: OptionalText = option(
        None, f"shared secret every worker and gateway must send ({SECRET_HEADER}); default: "
        "$LLMPLATFORM_CLUSTER_SECRET (prefer it: flags show in ps). Unset: no secret is required",
        secret=True)
    allowed_worker_networks: CommaList = option(
        (), "comma-separated networks (e.g. 10.0.0.0/8,127.0.0.1/32) a worker's announced "
        "address must lie in, however it is spelled; host names must resolve into them "
        "(default: any address except bind-all, multicast, link-local, broadcast and cloud "
        "metadata endpoints)", metavar="CIDRS")
    confirm_timeout: float = option(
        ControllerConfig.confirm_timeout, "how long a registered worker that does not answer "
        "/worker_get_status yet is waited for (never routed meanwhile); stock FastChat workers "
        "register before they listen (default: %(default)s)", metavar="SECONDS")

    model_load_timeout: float = option(
        ControllerConfig.model_load_timeout, "seconds a model launched through the lifecycle API "
        "(POST /v1/admin/models) has for all its workers to register before it is failed and "
        "its workers stopped (default: %(default)s)", metavar="SECONDS", gt=0)
    on_demand_model: list[str] | None = option(
        None, "a model launchable on demand, as the JSON body of POST /v1/admin/models, e.g. "
        "'{\"name\": \"m\", \"model_path\": \"/models/m\", \"keep_alive\": 300}': listed "
        "in /v1/models as not loaded, started by the first request for it. Repeatable",
        metavar="JSON", repeatable=True)

    @cached_property
    def controller_config(self) -> ControllerConfig:
        """The app's section of these settings (checked when the settings are made)."""
        cache_aware = CacheAwareConfig(
            balance_threshold=self.cache_aware_balance_threshold,
            cold_balance_threshold=self.cache_aware_cold_balance_threshold,
            heat_half_life=self.cache_aware_heat_half_life,
            entry_ttl_s=self.cache_aware_entry_ttl,
            max_chunks_per_worker=self.cache_aware_max_chunks_per_worker,
            max_sessions=self.cache_aware_max_sessions)
        on_demand = tuple(LaunchModelRequest.model_validate_json(spec)
                          for spec in self.on_demand_model or ())
        return self.section(ControllerConfig, guard=self.guard_config(), cache_aware=cache_aware,
                            on_demand_models=on_demand)


def main(argv: Sequence[str] | None = None) -> None:
    settings = ControllerServiceSettings.parse(argv)
    configure_logging(settings.log_level, settings.log_format)
    config = settings.controller_config
    log_summary(logging.getLogger("llmplatform.controller"), "llmplatform controller",
                controller_summary(config, listen_url(settings.host, settings.port)))
    settings.run(create_app(config))


def controller_summary(config: ControllerConfig, listen: str) -> dict[str, Any]:
    return {
        "listen": listen,
        "dispatch": config.dispatch_method.value,
        "heartbeat_expiration": f"{config.heartbeat_expiration:g}s",
        "cluster_secret": "on" if config.cluster_secret else "off",
        "metrics": f"{listen}/metrics",
    }


if __name__ == "__main__":
    main()
