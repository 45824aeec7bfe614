"""The web UI's settings: frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_PORT = 7860


def _http_url(name: str, value: str) -> str:
    value = value.strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} must be an http(s) URL, got {value!r}")
    return value


@dataclass(frozen=True)
class WebUISettings:
    api_base: str = "http://127.0.0.1:8000/v1"
    """The gateway's OpenAI base URL. A URL without a path gets `/v1`, as OpenAI clients expect."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer` to the gateway; None when the gateway needs no key."""
    controller_address: str | None = "http://127.0.0.1:21001"
    """Where the Cluster tab reads the worker list from; None hides the cluster view's data."""
    cluster_secret: str | None = None
    """The cluster's shared secret, sent to the controller when the cluster has one."""
    admin_keys: tuple[str, ...] = ()
    """Keys that open the Cluster tab (the gateway's admin keys); empty: the tab is open."""
    allowed_hosts: frozenset[str] | None = None
    """Host names a request may use in its `Host` header (lower case, IPv6 in brackets); None:
    any. `__main__` sets it from the bind address and `--allowed-hosts`
    (`utils.request_guard.allowed_hosts_for`); an app built without being told stays unchecked."""
    log_dir: Path = Path("logs")
    """Arena votes are appended to `<log_dir>/votes.jsonl` (created at the first vote)."""
    request_timeout: float = 600.0
    """Seconds the gateway may stay silent (before the first token or between two) before the
    chat shows a timeout."""
    controller_timeout: float = 5.0
    """Seconds allowed for one controller call of the Cluster tab."""
    cluster_refresh_s: float = 3.0
    """Seconds between two refreshes of the Cluster tab."""
    default_max_tokens: int = 512
    """The max-tokens slider's starting value."""
    max_tokens_limit: int = 4096
    """The max-tokens slider's upper end."""
    concurrency_limit: int = 64
    """Generations the UI runs at once over all browser sessions (Gradio's event queue); more
    wait in the queue. Each is one request to the gateway."""

    def __post_init__(self) -> None:
        api_base = _http_url("api_base", self.api_base)
        if not urlsplit(api_base).path:
            api_base += "/v1"
        object.__setattr__(self, "api_base", api_base)
        if self.controller_address is not None:
            object.__setattr__(
                self, "controller_address",
                _http_url("controller_address", self.controller_address))
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (pass None for no key)")
        object.__setattr__(self, "log_dir", Path(self.log_dir))
        object.__setattr__(self, "admin_keys", tuple(self.admin_keys))
        if any(not key or key != key.strip() for key in self.admin_keys):
            raise ValueError("admin_keys must not contain empty keys or keys with surrounding "
                             "whitespace")
        for name in ("request_timeout", "controller_timeout", "cluster_refresh_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens must be in [1, max_tokens_limit={self.max_tokens_limit}], "
                f"got {self.default_max_tokens}")
        if self.concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {self.concurrency_limit}")

    @property
    def votes_path(self) -> Path:
        return self.log_dir / "votes.jsonl"
