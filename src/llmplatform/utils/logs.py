"""Logging set-up shared by every service's ``__main__``."""

from __future__ import annotations

import logging

# Routes polled every few seconds: logging each call would bury everything else.
_QUIET_PATHS = ("/receive_heart_beat", "/health", "/worker_get_status")


class _DropPollingRequests(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn.access records carry (client, method, path, http_version, status).
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return not args[2].startswith(_QUIET_PATHS)
        return True


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO (heartbeats included); keep its warnings only.
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("uvicorn.access").addFilter(_DropPollingRequests())
