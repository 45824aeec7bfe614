"""Messages of the model lifecycle (contracts only): the gateway's `/v1/admin/models` and the
controller's routes behind it, and the controller's calls to each host's agent.

Who sends what (docs/serve.md, "Launching models at runtime"):

    admin client --POST/GET/DELETE /v1/admin/models--> gateway --/launch_model, /stop_model,
      /list_model_states, /ensure_model--> controller --/launch_workers, /stop_worker,
      /list_processes--> agent (one per host) --starts/stops--> model worker processes
    agent --/register_agent (at start, then every few seconds)--> controller

Unlike the FastChat messages these are ours alone, so requests refuse unknown fields: a typo in
an admin's launch is a 400, not a silently ignored option.
"""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

MANAGED_WORKER_FLAGS = frozenset({
    "--model-path", "--model-names", "--backend", "--kv-cache-memory", "--host", "--port",
    "--worker-address", "--controller-address", "--no-register", "--cluster-secret",
})
"""Worker flags a launch sets itself (from its own fields, or the agent's placement): a launch's
`worker_args` may not carry them."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ModelState(str, enum.Enum):
    LOADING = "loading"
    """Workers started, not all registered yet (`progress` says how many are)."""
    READY = "ready"
    DRAINING = "draining"
    """Being stopped: routed no new requests; its in-flight requests finish first."""
    FAILED = "failed"
    """A worker exited or never registered in time (`reason`); the others were stopped."""
    NOT_LOADED = "not_loaded"
    """Launchable on demand, no worker running: the first request for it starts one."""


class LaunchModelRequest(_Request):
    """`POST /v1/admin/models` (and the controller's `/launch_model`)."""

    name: str = Field(min_length=1, max_length=256, pattern=r"^[^\s,]+$",
                      description="The name requests use (the workers' --model-names).")
    model_path: str = Field(min_length=1, description="A local checkpoint folder or .gguf file.")
    backend: str = Field("auto", pattern=r"^[a-z_]+$", description="The workers' --backend.")
    kv_cache_memory: str | None = Field(
        None, description="Each worker's KV pool (--kv-cache-memory, e.g. 512MiB); None: the "
        "worker's default. Counted with the weights when checking the launch fits.")
    worker_args: list[str] = Field(default_factory=list, max_length=64,
                                   description="More worker flags, e.g. ['--dtype', 'float32'].")
    replicas: int = Field(1, ge=1, le=16)
    host: str | None = Field(None, description="The agent (its host name) to start them on; "
                             "None: each registered agent in turn until one has room.")
    on_demand: bool = Field(False, description="Register it only: listed as not loaded, started "
                            "by the first request for it.")
    keep_alive: float | None = Field(
        None, gt=0, description="Seconds idle after which an on-demand model is unloaded (None: "
        "kept until stopped).")


class StopModelRequest(_Request):
    name: str


class EnsureModelRequest(_Request):
    """The gateway asks for a model no worker serves: an on-demand one is started."""

    model: str


class ModelStatus(_Answer):
    name: str
    state: ModelState
    managed: bool = True
    """False for a model served by workers started some other way (a serve --worker, by hand):
    listed, but not stoppable through the lifecycle API."""
    progress: str | None = None
    """While loading: e.g. '1/2 workers registered, 12 s'."""
    reason: str | None = None
    """When failed: why (the worker's exit and the end of its log, or the timeout)."""
    replicas: int = 1
    workers: list[str] = Field(default_factory=list)
    host: str | None = None
    model_path: str | None = None
    on_demand: bool = False
    keep_alive: float | None = None
    idle_s: float | None = None
    """Seconds since a request for it was last routed or running (managed models)."""


class AgentHost(_Answer):
    host_name: str
    agent_address: str


class ListModelStatesResponse(_Answer):
    models: list[ModelStatus]
    hosts: list[AgentHost] = Field(default_factory=list)
    """The host agents launches can go to (registered, live)."""


# ---- controller <-> agent -------------------------------------------------------------------


class LaunchWorkersRequest(_Request):
    """The controller asks an agent for `replicas` workers of one model, all or none."""

    model_name: str
    model_path: str
    backend: str
    kv_cache_memory: str | None = None
    worker_args: list[str] = Field(default_factory=list)
    replicas: int = Field(1, ge=1, le=16)
    spec: LaunchModelRequest | None = None
    """The launch as it was asked for (on demand, keep_alive, ...): the agent keeps it with the
    workers and reports it back, so that a restarted controller takes the model over as it was."""
    check_only: bool = False
    """Check the flags and the path, start nothing (an on-demand model being registered: its
    memory is checked when it starts)."""


class ProcessState(str, enum.Enum):
    RUNNING = "running"
    EXITED = "exited"


class AgentProcess(_Answer):
    worker_address: str
    model_name: str
    pid: int
    state: ProcessState
    exit_reason: str | None = None
    """How it ended (exit status) and the last lines of its log."""
    reserved_bytes: int = 0
    """Weights plus KV pool this worker was admitted with."""
    spec: LaunchModelRequest | None = None
    """The launch that started it (`LaunchWorkersRequest.spec`)."""


class RegisterAgentRequest(_Request):
    """An agent announcing itself, with the workers it runs (a restarted controller adopts them)."""

    agent_address: str
    host_name: str
    processes: list[AgentProcess] = Field(default_factory=list)


class LaunchWorkersResponse(_Answer):
    workers: list[AgentProcess]


class StopWorkerRequest(_Request):
    worker_address: str


class AgentStatus(_Answer):
    host_name: str
    processes: list[AgentProcess]
