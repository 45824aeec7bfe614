"""What every service's one-line startup summary shares. Each service builds its own summary
(what it is, what it runs, where it listens and whom it talks to) from the objects it runs with,
so it cannot drift from them, and logs it once from its ``__main__``
(:func:`llmplatform.utils.logs.log_summary`) just before the server starts listening."""

from __future__ import annotations


def listen_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host and not host.startswith("[") else \
        f"http://{host}:{port}"
