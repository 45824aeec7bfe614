"""Each service's one-line startup summary: what it is, what it runs, where it listens and whom
it talks to. Built from the same objects the service runs with, so it cannot drift from them;
logged once by each ``__main__`` (:func:`llmplatform.utils.logs.log_summary`) just before the
server starts listening."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmplatform.controller.config import ControllerConfig
    from llmplatform.llm.base import LLMBackend
    from llmplatform.model_worker.app import WorkerSettings
    from llmplatform.openai_api.settings import GatewaySettings


def listen_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else \
        f"http://{host}:{port}"


def worker_summary(llm: LLMBackend, settings: WorkerSettings, listen: str) -> dict[str, Any]:
    info = llm.backend_info()
    tasks = [str(task) for task in llm.facts.tasks]
    if info.num_kv_blocks is not None and info.kv_block_size is not None:
        kv = (f"{info.num_kv_blocks} blocks x {info.kv_block_size} tokens = "
              f"{info.kv_capacity_tokens} tokens")
    elif "generate" not in tasks:
        kv = "none (embeddings only)"  # an encoder: one forward pass per batch, nothing kept
    else:
        kv = "per request (no shared pool)"
    registered = settings.register and settings.controller_address
    return {
        "model": ",".join(llm.model_names),
        "backend": info.backend,
        "serves": ",".join(tasks),
        "dtype": info.dtype,
        "device": info.device,
        **({"attention": info.attention} if info.attention else {}),
        **({"weights": info.weights} if info.weights else {}),
        "kv_cache": kv,
        **({"tensor_parallel": f"{info.tensor_parallel_size} ranks, {info.num_kv_heads_per_rank} "
                               f"KV head(s) and {info.num_kv_blocks} KV blocks per rank"}
           if info.tensor_parallel_size > 1 else {}),
        "max_model_len": llm.context_length,
        "concurrency": settings.limit_worker_concurrency,
        "listen": listen,
        "address": settings.worker_address or listen,
        "controller": settings.controller_address if registered else "none (not registering)",
        "metrics": f"{listen}/metrics",
    }


def gateway_summary(settings: GatewaySettings, listen: str) -> dict[str, Any]:
    return {
        "listen": listen,
        "api": f"{listen}/v1",
        "controller": settings.controller_address,
        "routing": (f"local (refresh {settings.worker_refresh_interval:g}s)"
                    if settings.routing.value == "local" else settings.routing.value),
        "auth": "on" if settings.api_keys else "off",
        "cors": ",".join(settings.allowed_origins) or "off",
        "metrics": f"{listen}/metrics",
    }


def controller_summary(config: ControllerConfig, listen: str) -> dict[str, Any]:
    return {
        "listen": listen,
        "dispatch": config.dispatch_method.value,
        "heartbeat_expiration": f"{config.heartbeat_expiration:g}s",
        "cluster_secret": "on" if config.cluster_secret else "off",
        "metrics": f"{listen}/metrics",
    }
