"""Messages between workers, gateways and the controller (contracts only, no logic).

The wire format is FastChat's (see shared/PROTOCOL.md). Every model ignores unknown fields so
that a stock FastChat peer, or a newer one of ours, never gets a validation error for sending
more than we read. Our additions (the load facts) are optional, so a stock worker that sends
only the two FastChat fields is still a complete message.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from llmplatform.protocol.lora import LoRAAdapterCard


class _Message(BaseModel):
    """Base for controller messages: tolerant of extra fields, as FastChat peers send them."""

    model_config = ConfigDict(extra="ignore")


class LoadFacts(_Message):
    """Optional load facts our workers report besides FastChat's `queue_length`.

    A stock FastChat worker never sends them; `None` means "not reported", never zero.
    """

    num_running: int | None = Field(default=None, ge=0, description="Requests being decoded now.")
    num_waiting: int | None = Field(default=None, ge=0, description="Requests queued, not started.")
    kv_cache_usage: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Fraction of KV-cache blocks in use, 0..1."
    )
    # The prefix cache (paged workers), cumulative since the worker started: the web UI shows
    # the hit rate, and cache_aware dispatch forgets what it believed a worker holds once its
    # reset count moves.
    prefix_cache_queries: int | None = Field(
        default=None, ge=0, description="Prompt tokens looked up in the prefix cache.")
    prefix_cache_hits: int | None = Field(
        default=None, ge=0, description="Prompt tokens found in the prefix cache.")
    prefix_cache_resets: int | None = Field(
        default=None, ge=0, description="Times the prefix cache was emptied.")


class WorkerStatus(LoadFacts):
    """What `/worker_get_status` returns, on a worker or (aggregated) on a controller."""

    model_names: list[str]
    # FastChat workers always report 1. A controller with no workers aggregates to 0, which is
    # why 0 is allowed; dispatch treats a speed-0 worker as the last resort.
    speed: int = Field(default=1, ge=0, description="Relative throughput weight.")
    queue_length: int = Field(default=0, ge=0, description="Requests running or waiting.")
    # Ours only, sent at registration (it does not change while a worker runs): how many requests
    # the worker runs at once at most; least_load divides the load by it. None: not reported.
    max_num_running: int | None = Field(
        default=None, ge=1, description="Requests the worker runs at once at most (batch capacity)."
    )
    # Ours only, sent at registration: which LLM implementation serves ("paged", "hf").
    backend: str | None = Field(default=None, description="The worker's inference backend.")
    # Ours only, sent at registration: what the model serves ("generate", "embed"). None: not
    # reported (a stock FastChat worker: it generates, and may embed too).
    tasks: list[str] | None = Field(default=None, max_length=8, description="What the model serves.")
    # Ours only: the LoRA adapters among model_names, each with its base model (vLLM's `parent`)
    # and path (`root`), for the gateway's /v1/models. None: not reported.
    lora_adapters: list[LoRAAdapterCard] | None = Field(default=None, max_length=4096)


class RegisterWorkerRequest(_Message):
    """Body of `POST /register_worker`."""

    worker_name: str = Field(max_length=2048, description="The worker's base URL, e.g. http://127.0.0.1:21002.")
    check_heart_beat: bool = True
    # The models the worker claims (FastChat sends its whole status). Not trusted: the worker is
    # routed only once its own /worker_get_status lists every one of them. None: the
    # controller asks /worker_get_status itself.
    worker_status: WorkerStatus | None = None
    multimodal: bool = False
    # Ours only: a random id per worker process. A live entry at the same URL with another id is
    # a second worker announcing that URL, and is refused (409) rather than replaced.
    instance_id: str | None = Field(default=None, max_length=128)


class HeartbeatRequest(LoadFacts):
    """Body of `POST /receive_heart_beat`."""

    worker_name: str
    queue_length: int = Field(ge=0)
    # Ours only: the id the worker registered with; a beat with another id (or none, from a
    # worker that registered with one) is not its beat.
    instance_id: str | None = Field(default=None, max_length=128)


class HeartbeatResponse(_Message):
    """`exist: false` tells the worker to register again (e.g. after a controller restart)."""

    exist: bool


class ListModelsResponse(_Message):
    """Response of `/list_models`, `/list_language_models`, `/list_multimodal_models`."""

    models: list[str]


class GetWorkerAddressRequest(_Message):
    """Body of `POST /get_worker_address`."""

    model: str
    # Ours: workers not to pick (a gateway retrying elsewhere after one failed). A stock
    # controller ignores the field; the gateway then notices a repeated address and stops.
    exclude: list[str] = Field(default_factory=list, max_length=64)
    # Ours, for cache_aware dispatch (other methods ignore them): the chain hashes of the
    # prompt's leading chunks (routing/prefix_tree.py `prefix_hashes`) and a session key's
    # hash. A stock controller ignores both.
    prefix_hashes: list[int] = Field(default_factory=list, max_length=512)
    session: int | None = None


class DeregisterWorkerRequest(_Message):
    """Body of `POST /deregister_worker` (ours): a worker leaving (shutting down, engine dead)."""

    worker_name: str
    # The id the worker registered with: only the worker itself may take its entry away.
    instance_id: str | None = Field(default=None, max_length=128)


class DeregisterWorkerResponse(_Message):
    """`removed` is False when the controller did not know the worker."""

    removed: bool


class GetWorkerAddressResponse(_Message):
    """`address` is "" when no live worker serves the model (FastChat's convention)."""

    address: str
    # Ours: why this worker (a dispatch `Reason` value), for the gateway's debug log.
    reason: str | None = None


class RefreshAllWorkersResponse(_Message):
    """Response of `POST /refresh_all_workers` (a stock client ignores the body)."""

    removed: list[str] = Field(default_factory=list, description="Workers dropped as unreachable.")


class WorkerDescription(_Message):
    """One live worker as `GET /list_workers` shows it (read-only; ours only)."""

    worker_name: str
    model_names: list[str]
    backend: str | None = None
    tasks: list[str] | None = Field(default=None, description="What the model serves (ours).")
    lora_adapters: list[LoRAAdapterCard] | None = Field(
        default=None, description="The LoRA adapters among model_names (ours).")
    speed: int
    queue_length: int
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    last_heartbeat_age_s: float = Field(ge=0.0, description="Seconds since its last heartbeat.")
    # Optional, so that an older controller's listing still parses. With them (and the
    # controller's dispatch method) a gateway can rank workers exactly as the controller would.
    max_num_running: int | None = Field(
        default=None, ge=1, description="Batch capacity reported at registration."
    )
    num_dispatched: int = Field(
        default=0, ge=0, description="Requests the controller sent it since its last heartbeat."
    )
    prefix_cache_queries: int | None = Field(default=None, ge=0)
    prefix_cache_hits: int | None = Field(default=None, ge=0)
    cache_epoch: str | None = Field(
        default=None, description="Changes when the worker's prefix cache is known to be gone.")


class CacheAwareOptions(_Message):
    """The controller's cache_aware knobs, so a gateway routing locally uses the same ones."""

    balance_threshold: int = Field(ge=0)
    # None from a controller older than these two: the gateway's defaults then.
    cold_balance_threshold: int | None = Field(default=None, ge=0)
    heat_half_life: float | None = Field(default=None, gt=0)
    entry_ttl_s: float = Field(gt=0)
    max_chunks_per_worker: int = Field(ge=1)
    max_sessions: int = Field(ge=1)


MAX_REASON_CHARS = 500
"""A down worker's reason is one line for a table, whoever sent it."""


class WorkerStateReport(_Message):
    """`POST /report_worker_state` (ours): the supervisor (`llmplatform serve`) left a worker down
    after a crash loop, or a retry of it is healthy again."""

    worker_name: str = Field(min_length=1, max_length=2048,
                             description="The address the worker registers with.")
    service: str | None = Field(default=None, max_length=100,
                                description="The supervisor's name for it, e.g. 'worker 1'.")
    down: bool
    reason: str | None = Field(default=None, max_length=MAX_REASON_CHARS)
    retry_in_s: float | None = Field(default=None, ge=0.0,
                                     description="Seconds until the supervisor retries it.")


class DownWorker(_Message):
    """A worker the supervisor left down: not routed to, retried later."""

    worker_name: str
    service: str | None = None
    model_names: list[str] = Field(default_factory=list,
                                   description="What it served when last registered (may be empty).")
    reason: str
    down_for_s: float = Field(ge=0.0)
    retry_in_s: float | None = Field(default=None, ge=0.0,
                                     description="Seconds until its next retry; 0 while one runs.")


class ListWorkersResponse(_Message):
    """Response of `GET /list_workers`: live workers sorted by name, and those left down."""

    workers: list[WorkerDescription]
    # The controller's `--dispatch-method` (a `DispatchMethod` value); None from an older
    # controller. A string, not the enum: contracts do not import the controller.
    dispatch_method: str | None = None
    # Set when dispatch_method is cache_aware.
    cache_aware: CacheAwareOptions | None = None
    # Workers a supervisor reported down after a crash loop (empty from an older controller).
    down_workers: list[DownWorker] = Field(default_factory=list)


class ErrorResponse(_Message):
    """Body of a 4xx answer from the controller: a client mistake, never a 500."""

    error: str
