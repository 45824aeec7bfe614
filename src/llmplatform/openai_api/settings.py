"""The gateway's settings: frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    controller_address: str = "http://127.0.0.1:21001"
    """Base URL of the controller that knows which worker serves which model."""
    api_keys: tuple[str, ...] = ()
    """When non-empty, every /v1 route needs `Authorization: Bearer <one of these>` (or of
    `admin_api_keys`)."""
    admin_api_keys: tuple[str, ...] = ()
    """Keys for the /v1/admin routes (and, like `api_keys`, for every other /v1 route). Empty:
    with `api_keys` set, every API key is an admin key; with no keys at all, /v1/admin is open
    like the rest of /v1."""
    allowed_origins: tuple[str, ...] = ("*",)
    """CORS origins; empty: no CORS middleware at all."""
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    worker_timeout: float = 600.0
    """Seconds a worker may stay silent (inside a stream, or before answering) before a 504."""
    controller_timeout: float = 10.0
    """Seconds allowed for one controller call."""
    connect_timeout: float = 5.0
    """Seconds allowed to open a connection to the controller or a worker."""
    abort_timeout: float = 5.0
    """Seconds allowed for the best-effort `/worker_abort` call after a client disconnect."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "controller_address", self.controller_address.strip().rstrip("/"))
        if not self.controller_address.startswith(("http://", "https://")):
            raise ValueError(f"controller_address must be an http(s) URL, got {self.controller_address!r}")
        for name in ("api_keys", "admin_api_keys", "allowed_origins", "allowed_methods",
                     "allowed_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if any(not key for key in self.api_keys + self.admin_api_keys):
            raise ValueError("api_keys and admin_api_keys must not contain empty keys")
        for name in ("worker_timeout", "controller_timeout", "connect_timeout", "abort_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
