"""`python -m llmplatform.webui`: read the settings, build the app, run uvicorn.

`WebUIServiceSettings` declares every flag (and so every `LLMPLATFORM_*` variable and
cluster-file key, `utils/settings.py`); `main(argv)` is public so `llmplatform webui ...` can
reuse it. Gradio is imported only once the settings are good (it takes seconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from llmplatform.utils.request_guard import allowed_hosts_for
from llmplatform.utils.service_settings import ALLOWED_HOSTS_HELP, LoggingSettings
from llmplatform.utils.settings import CommaList, OptionalText, option
from llmplatform.webui.settings import DEFAULT_PORT, WebUISettings

SHUTDOWN_GRACE_S = 3.0
"""On SIGTERM, how long open page connections may delay exit (the UI holds no work to drain)."""


class WebUIServiceSettings(LoggingSettings):
    cli_prog = "python -m llmplatform.webui"
    cli_description = "The chat web UI (Chat, Arena and Cluster tabs), a client of the gateway."
    sections = ("webui_settings",)

    api_base: str = option(WebUISettings.api_base, "the gateway's OpenAI base URL; a URL without "
                           "a path gets /v1 (default: %(default)s)")
    api_key: OptionalText = option(None, "API key for the gateway, when it needs one (prefer the "
                                   "environment variable to the flag: a flag shows in `ps`)",
                                   secret=True)
    controller_address: str = option(
        "http://127.0.0.1:21001", "controller the Cluster tab reads the workers from; 'none' "
        "turns the view off (default: %(default)s)")
    cluster_secret: OptionalText = option(
        None, "the cluster's shared secret, for the Cluster tab's controller call (default: "
        "$LLMPLATFORM_CLUSTER_SECRET, else none)", secret=True)
    host: str = option("127.0.0.1", "bind address; anything but loopback exposes the UI, and "
                       "through it the gateway, to the network (default: %(default)s)")
    port: int = option(DEFAULT_PORT, "(default: %(default)s)")
    allowed_hosts: CommaList = option((), ALLOWED_HOSTS_HELP, metavar="NAMES")
    admin_api_keys: CommaList = option(
        (), "comma-separated keys that open the Cluster tab (worker addresses and load); the "
        "gateway's --admin-api-keys, else its --api-keys (`serve` passes them on). Without any, "
        "the tab is open (default: $LLMPLATFORM_ADMIN_API_KEYS)", secret=True)
    log_dir: Path = option(WebUISettings.log_dir, "arena votes are appended to "
                           "LOG_DIR/votes.jsonl (default: %(default)s)")
    max_tokens: int = option(WebUISettings.default_max_tokens, "starting value of the "
                             "max-new-tokens slider (default: %(default)s)")
    concurrency_limit: int = option(
        WebUISettings.concurrency_limit, "generations run at once over all browser sessions; more "
        "wait in Gradio's queue (default: %(default)s)")
    cluster_refresh: float = option(WebUISettings.cluster_refresh_s, "seconds between refreshes "
                                    "of the Cluster tab (default: %(default)s)")
    request_timeout: float = option(
        WebUISettings.request_timeout, "seconds the gateway may stay silent during an answer "
        "before the chat shows a timeout (default: %(default)s)")

    @cached_property
    def webui_settings(self) -> WebUISettings:
        """The app's section of these settings (checked when the settings are made)."""
        controller = self.controller_address
        return self.section(
            WebUISettings,
            controller_address=None if controller.strip().lower() == "none" else controller,
            allowed_hosts=allowed_hosts_for(self.host, self.allowed_hosts),
            admin_keys=self.admin_api_keys,
            default_max_tokens=self.max_tokens,
            max_tokens_limit=max(WebUISettings.max_tokens_limit, self.max_tokens),
            cluster_refresh_s=self.cluster_refresh)


def main(argv: Sequence[str] | None = None) -> None:
    settings = WebUIServiceSettings.parse(argv)
    import uvicorn

    from llmplatform.utils.logs import configure_logging, uvicorn_log_options
    from llmplatform.webui.app import create_app  # imports Gradio: seconds, so only now

    configure_logging(settings.log_level, settings.log_format)
    app = create_app(settings.webui_settings)
    uvicorn.run(app, host=settings.host, port=settings.port,
                timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                **uvicorn_log_options(settings.log_level))


if __name__ == "__main__":
    main()
