"""The Cluster tab's launch and stop controls: the gateway's `/v1/admin/models`, like any client.

The key is the one the visitor typed in the tab (else the UI's own `--api-key`); the gateway
decides: a key that is not an admin key gets its 401/403, shown as is. Nothing here trusts the
page: every value goes to the gateway, which checks it (400 for a bad flag or path, 409 for a
launch that does not fit, with what would).
"""

from __future__ import annotations

import shlex
from urllib.parse import quote

import httpx

from llmplatform.webui.settings import WebUISettings

MAX_SHOWN_CHARS = 600
ADMIN_MODELS = "/admin/models"
"""Under the gateway's OpenAI base URL (`--api-base`, .../v1)."""


def _text(value: object) -> str:
    """`value` as one short line (gateway text is shown, never rendered as markup by us)."""
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"


class ModelControls:
    def __init__(self, settings: WebUISettings) -> None:
        self._settings = settings
        self._client = httpx.AsyncClient(
            base_url=settings.api_base.rstrip("/"),
            timeout=httpx.Timeout(settings.request_timeout, connect=5.0))

    async def close(self) -> None:
        await self._client.aclose()

    def _headers(self, admin_key: str | None) -> dict[str, str]:
        key = (admin_key or "").strip() or self._settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _call(self, admin_key: str | None, method: str, path: str, body: object = None
                    ) -> tuple[bool, object]:
        try:
            response = await self._client.request(method, path, json=body,
                                                  headers=self._headers(admin_key))
        except httpx.HTTPError as exc:
            return False, f"the gateway could not be reached ({type(exc).__name__})"
        try:
            data = response.json()
        except ValueError:
            return False, f"the gateway answered HTTP {response.status_code}"
        if response.status_code >= 400:
            error = data.get("error") if isinstance(data, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            return False, f"HTTP {response.status_code}: {message or 'refused'}"
        return True, data

    async def launch(self, admin_key: str | None, name: str, model_path: str, backend: str,
                     kv_cache_memory: str, worker_flags: str, replicas: float | None,
                     on_demand: bool, keep_alive: float | None) -> str:
        try:
            worker_args = shlex.split(worker_flags or "")
        except ValueError as exc:
            return f"**Not launched:** worker flags: {_text(exc)}"
        body = {"name": (name or "").strip(), "model_path": (model_path or "").strip(),
                "backend": backend or "auto", "kv_cache_memory": (kv_cache_memory or "").strip() or None,
                "worker_args": worker_args, "replicas": int(replicas or 1),
                "on_demand": bool(on_demand), "keep_alive": keep_alive or None}
        ok, answer = await self._call(admin_key, "POST", ADMIN_MODELS, body)
        if not ok:
            return f"**Not launched:** {_text(answer)}"
        state = answer.get("state") if isinstance(answer, dict) else "?"
        return f"**{_text(body['name'])}**: {_text(state)}"

    async def stop(self, admin_key: str | None, name: str) -> str:
        name = (name or "").strip()
        if not name:
            return "**Not stopped:** give the model's name."
        ok, answer = await self._call(admin_key, "DELETE", f"{ADMIN_MODELS}/{quote(name, safe='/')}")
        if not ok:
            return f"**Not stopped:** {_text(answer)}"
        return f"**{_text(name)}**: {_text(answer.get('state') if isinstance(answer, dict) else '?')}"

    async def listing(self, admin_key: str | None) -> str:
        """One line per model: name, state and what explains it (progress, reason)."""
        ok, answer = await self._call(admin_key, "GET", ADMIN_MODELS)
        if not ok:
            return f"Models: {_text(answer)}"
        models = answer.get("data", []) if isinstance(answer, dict) else []
        if not models:
            return "No models."
        lines = []
        for model in models:
            detail = model.get("progress") or model.get("reason") or (
                "on demand" if model.get("on_demand") else "")
            lines.append(f"- **{_text(model.get('name'))}**: {_text(model.get('state'))}"
                         + (f" ({_text(detail)})" if detail else ""))
        return "\n".join(lines)
