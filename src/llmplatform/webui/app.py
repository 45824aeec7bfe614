"""The web UI's app factory: a Gradio Blocks page mounted on a FastAPI app.

`create_app(settings) -> FastAPI` builds everything (nothing runs at import time): `GET /health`
for `llmplatform serve`, and the Gradio page at `/`. Uvicorn runs it like every other service,
so tests serve it with `serve_in_thread`. Gradio's analytics are off (nothing outside this
machine may be reached) and it is never shared through Gradio's tunnel; the page serves no files
from disk except Gradio's own assets (no upload component, uploads refused, no `allowed_paths`),
and the votes log is explicitly blocked.

Model text reaches the page only through `components.SafeChatbot` and `SafeMarkdown`, which make
it inert on the server (`safe_markdown`). Every request passes `guard.PageGuard` first: the Host
check (DNS rebinding), and headers that keep the page from being framed, from running a script
it did not ship, and from fetching anything for what it shows (images, media and frames from the
page's own origin only, no DNS prefetching of links, no Referer). The Cluster tab shows nothing
without the admin key when one is configured (`cluster.ClusterView`), whoever calls its event. A handler's exception shows as
Gradio's bare "Error", never its text (`show_error=False`): the log has the details.

The page is wiring only: the handlers live in `chat`, `arena`, `cluster` and `model_controls`, free of Gradio.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

# Before Gradio is imported: it reads this at import time (version checks, telemetry).
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import pandas as pd  # noqa: E402  (a Gradio dependency; Dataframe values)
from fastapi import FastAPI  # noqa: E402

from llmplatform.webui.arena import VOTES, ArenaHandlers, ArenaSession, VoteLog  # noqa: E402
from llmplatform.webui.chat import TOOL_CHOICES, ChatHandlers  # noqa: E402
from llmplatform.webui.cluster import COLUMNS, ClusterView  # noqa: E402
from llmplatform.webui.components import safe_chatbot, safe_markdown  # noqa: E402
from llmplatform.webui.gateway import GatewayClient  # noqa: E402
from llmplatform.webui.guard import PageGuard  # noqa: E402
from llmplatform.webui.messages import drop_last_answer  # noqa: E402
from llmplatform.webui.model_controls import ModelControls  # noqa: E402
from llmplatform.webui.settings import WebUISettings  # noqa: E402

TITLE = "llmplatform"

class Handlers:
    """Everything the page calls, built from the settings (tests build their own)."""

    def __init__(self, settings: WebUISettings) -> None:
        self.settings = settings
        self.client = GatewayClient(settings)
        self.chat = ChatHandlers(self.client)
        self.arena = ArenaHandlers(self.client, VoteLog(settings.votes_path))
        self.cluster = ClusterView(settings)
        self.models = ModelControls(settings)

    async def close(self) -> None:
        await self.client.close()
        await self.cluster.close()
        await self.models.close()


def _pick(models: list[str], current: str | None, fallback_index: int = 0) -> str | None:
    if current in models:
        return current
    if not models:
        return None
    return models[min(fallback_index, len(models) - 1)]


def _model_dropdown(label: str, elem_id: str) -> gr.Dropdown:
    # Choices arrive per page load from /v1/models. A custom value is allowed so that a model the
    # list has not caught up with can still be typed in (the gateway judges it, and any error
    # shows in the chat), and so API callers, who never load the list, can name one.
    return gr.Dropdown(label=label, choices=[], allow_custom_value=True, elem_id=elem_id)


def _request_controls(
    settings: WebUISettings, prefix: str
) -> tuple[gr.Slider, gr.Slider, gr.Slider, gr.Checkbox]:
    with gr.Accordion("Parameters", open=False):
        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature",
                                elem_id=f"{prefix}-temperature")
        top_p = gr.Slider(0.0, 1.0, value=1.0, step=0.05, label="Top p", elem_id=f"{prefix}-top-p")
        max_tokens = gr.Slider(1, settings.max_tokens_limit, value=settings.default_max_tokens,
                               step=1, label="Max new tokens", elem_id=f"{prefix}-max-tokens")
        json_mode = gr.Checkbox(False, label="JSON mode (the answer is a JSON object)",
                                elem_id=f"{prefix}-json-mode")
    return temperature, top_p, max_tokens, json_mode


def _composer(prefix: str, placeholder: str
              ) -> tuple[gr.Textbox, gr.Button, gr.Button, gr.Button, gr.Button]:
    """The input box with its Send button, then Stop, Regenerate and Clear."""
    with gr.Row():
        text = gr.Textbox(show_label=False, scale=8, elem_id=f"{prefix}-input", placeholder=placeholder)
        send = gr.Button("Send", variant="primary", scale=1, elem_id=f"{prefix}-send")
    with gr.Row():
        stop = gr.Button("Stop", variant="stop", elem_id=f"{prefix}-stop")
        regenerate = gr.Button("Regenerate", elem_id=f"{prefix}-regenerate")
        clear = gr.Button("Clear", elem_id=f"{prefix}-clear")
    return text, send, stop, regenerate, clear


def _tools_controls() -> tuple[gr.Textbox, gr.Dropdown]:
    with gr.Accordion("Tools (advanced)", open=False):
        tools = gr.Textbox(label="Tools (JSON)", lines=4, max_lines=20, elem_id="chat-tools",
                           placeholder='[{"type": "function", "function": {"name": "get_weather",'
                                       ' "parameters": {"type": "object", "properties": '
                                       '{"city": {"type": "string"}}}}}]',
                           info="An OpenAI tools list sent with each message. The page runs "
                                "no tool: it shows the calls the model makes.")
        tool_choice = gr.Dropdown(list(TOOL_CHOICES), value=TOOL_CHOICES[0], label="Tool choice",
                                  elem_id="chat-tool-choice")
    return tools, tool_choice


def build_blocks(handlers: Handlers) -> gr.Blocks:
    settings = handlers.settings
    chat, arena, cluster = handlers.chat, handlers.arena, handlers.cluster

    with gr.Blocks(title=TITLE, analytics_enabled=False) as demo:
        safe_markdown(f"## {TITLE}  \nChat with the models this platform serves.")
        with gr.Row():
            refresh_models = gr.Button("Refresh models", size="sm", scale=0,
                                       elem_id="refresh-models")
            models_status = safe_markdown(elem_id="models-status")

        # ---- Chat -------------------------------------------------------------------------------
        with gr.Tab("Chat", id="chat", elem_id="tab-chat") as chat_tab:
            chat_model = _model_dropdown("Model", "chat-model")
            system_prompt = gr.Textbox(label="System prompt (optional)", lines=1,
                                       elem_id="chat-system")
            chatbot = safe_chatbot(label="Chat", height=420, elem_id="chat-chatbot",
                                  buttons=["copy"])
            chat_input, chat_send, chat_stop, chat_regenerate, chat_clear = _composer(
                "chat", "Type a message and press Enter")
            chat_temperature, chat_top_p, chat_max_tokens, chat_json = _request_controls(
                settings, "chat")
            chat_tools, chat_tool_choice = _tools_controls()

        # ---- Arena ------------------------------------------------------------------------------
        with gr.Tab("Arena", id="arena", elem_id="tab-arena") as arena_tab:
            safe_markdown("Two models answer the same prompt side by side. Vote for the better "
                         "one; votes are logged on the server.")
            arena_session = gr.State(None)  # an ArenaSession, held server-side by Gradio
            with gr.Row():
                arena_model_a = _model_dropdown("Model A", "arena-model-a")
                arena_model_b = _model_dropdown("Model B", "arena-model-b")
            with gr.Row():
                chatbot_a = safe_chatbot(label="Model A", height=360, elem_id="arena-chatbot-a")
                chatbot_b = safe_chatbot(label="Model B", height=360, elem_id="arena-chatbot-b")
            with gr.Row():
                vote_buttons = {
                    kind: gr.Button(label, interactive=False, elem_id=f"vote-{kind}")
                    for kind, label in VOTES.items()
                }
            vote_status = safe_markdown(elem_id="arena-vote-status")
            arena_input, arena_send, arena_stop, arena_regenerate, arena_clear = _composer(
                "arena", "Type a prompt for both models")
            arena_temperature, arena_top_p, arena_max_tokens, arena_json = _request_controls(
                settings, "arena")

        # ---- Cluster ----------------------------------------------------------------------------
        with gr.Tab("Cluster", id="cluster", elem_id="tab-cluster") as cluster_tab:
            # Shown only when admin keys are configured; its value goes with every refresh, and
            # the handler checks it (the event is callable over Gradio's API without the page).
            cluster_key = gr.Textbox(label="Admin key", type="password", lines=1,
                                     visible=cluster.needs_key, elem_id="cluster-admin-key")
            cluster_summary = safe_markdown(elem_id="cluster-summary")
            cluster_table = gr.Dataframe(value=pd.DataFrame([], columns=COLUMNS),
                                         interactive=False, wrap=True, elem_id="cluster-table")
            cluster_refresh = gr.Button("Refresh now", size="sm", elem_id="cluster-refresh")
            # Launch and stop models at runtime: the gateway's /v1/admin/models with the key
            # above, which the gateway checks (an admin key).
            with gr.Accordion("Models: launch and stop (admin)", open=False):
                models_list = safe_markdown(elem_id="cluster-models")
                with gr.Row():
                    launch_name = gr.Textbox(label="Name", lines=1, elem_id="launch-name")
                    launch_path = gr.Textbox(label="Model path on the host", lines=1,
                                             elem_id="launch-path")
                    launch_backend = gr.Dropdown(["auto", "paged", "hf"], value="auto",
                                                 label="Backend", elem_id="launch-backend")
                with gr.Row():
                    launch_kv = gr.Textbox(label="KV cache memory (e.g. 512MiB)", lines=1,
                                           elem_id="launch-kv")
                    launch_replicas = gr.Number(1, precision=0, minimum=1, maximum=16,
                                                label="Replicas", elem_id="launch-replicas")
                    launch_on_demand = gr.Checkbox(label="On demand", elem_id="launch-on-demand")
                    launch_keep_alive = gr.Number(None, minimum=1, label="Keep alive (s)",
                                                  elem_id="launch-keep-alive")
                launch_flags = gr.Textbox(label="More worker flags (e.g. --dtype float32)",
                                          lines=1, elem_id="launch-flags")
                with gr.Row():
                    launch_button = gr.Button("Launch", elem_id="launch-button")
                    stop_name = gr.Textbox(label="Model to stop", lines=1, elem_id="stop-name")
                    stop_button = gr.Button("Stop", variant="stop", elem_id="stop-button")
                models_result = safe_markdown(elem_id="models-result")
            # Ticks only while the tab is shown: an open page polls the controller for nothing
            # otherwise.
            cluster_timer = gr.Timer(settings.cluster_refresh_s, active=False)

        # ---- Events: models ---------------------------------------------------------------------
        async def update_models(
            current: str | None, current_a: str | None, current_b: str | None
        ) -> tuple[Any, Any, Any, str]:
            models, status = await chat.list_models()
            return (gr.update(choices=models, value=_pick(models, current)),
                    gr.update(choices=models, value=_pick(models, current_a)),
                    gr.update(choices=models, value=_pick(models, current_b, 1)),
                    status)

        model_io = dict(fn=update_models, inputs=[chat_model, arena_model_a, arena_model_b],
                        outputs=[chat_model, arena_model_a, arena_model_b, models_status])
        demo.load(**model_io)
        refresh_models.click(**model_io)

        # ---- Events: chat -----------------------------------------------------------------------
        chat_args = [chat_model, system_prompt, chat_temperature, chat_top_p, chat_max_tokens,
                     chatbot, chat_json, chat_tools, chat_tool_choice]
        chat_runs = [
            trigger(chat.add_user_message, [chat_input, chatbot], [chat_input, chatbot],
                    queue=False).then(chat.respond, chat_args, chatbot)
            for trigger in (chat_input.submit, chat_send.click)
        ]
        chat_runs.append(chat_regenerate.click(drop_last_answer, chatbot, chatbot, queue=False)
                         .then(chat.respond, chat_args, chatbot))
        # Cancelling the generator closes the gateway stream, which aborts the request.
        chat_stop.click(None, cancels=chat_runs)
        chat_clear.click(lambda: ([], ""), None, [chatbot, chat_input], queue=False,
                         cancels=chat_runs)

        # ---- Events: arena ----------------------------------------------------------------------
        votes_out = list(vote_buttons.values())

        def votes_enabled(session: ArenaSession | None) -> list[Any]:
            ready = isinstance(session, ArenaSession) and session.can_vote
            return [gr.update(interactive=ready) for _ in votes_out]

        def votes_disabled() -> list[Any]:
            return [gr.update(interactive=False) for _ in votes_out]

        def new_answers() -> list[Any]:  # the last vote's line goes; no vote until both answered
            return [""] + votes_disabled()

        arena_args = [arena_model_a, arena_model_b, arena_temperature, arena_top_p,
                      arena_max_tokens, chatbot_a, chatbot_b, arena_session, arena_json]
        arena_out = [chatbot_a, chatbot_b, arena_session]
        arena_runs = [
            trigger(arena.add_user_message, [arena_input, chatbot_a, chatbot_b],
                    [arena_input, chatbot_a, chatbot_b], queue=False)
            .then(new_answers, None, [vote_status] + votes_out, queue=False)
            .then(arena.respond, arena_args, arena_out)
            for trigger in (arena_input.submit, arena_send.click)
        ]

        def drop_both(history_a: Any, history_b: Any) -> tuple[Any, Any]:
            return drop_last_answer(history_a), drop_last_answer(history_b)

        arena_runs.append(
            arena_regenerate.click(drop_both, [chatbot_a, chatbot_b], [chatbot_a, chatbot_b],
                                   queue=False)
            .then(new_answers, None, [vote_status] + votes_out, queue=False)
            .then(arena.respond, arena_args, arena_out))
        for run in arena_runs:
            run.then(votes_enabled, arena_session, votes_out, queue=False)
        # A stopped round has no complete pair: nothing to vote on.
        arena_stop.click(votes_enabled, arena_session, votes_out, cancels=arena_runs,
                         queue=False)
        arena_clear.click(lambda: ([], [], "", "", None), None,
                          [chatbot_a, chatbot_b, arena_input, vote_status, arena_session],
                          queue=False, cancels=arena_runs
                          ).then(votes_disabled, None, votes_out, queue=False)

        def vote_handler(kind: str) -> Callable[..., Coroutine[Any, Any, list[Any]]]:
            # The vote's kind is the button's own (no input), and the pair is the session's:
            # a caller of the API endpoint has nothing to pass but its session.
            async def record(session: ArenaSession | None) -> list[Any]:
                status, session = await arena.vote(kind, session)
                return [status, session] + votes_disabled()  # one vote per answered pair
            return record

        for kind, button in vote_buttons.items():
            button.click(vote_handler(kind), arena_session,
                         [vote_status, arena_session] + votes_out)

        # ---- Events: cluster --------------------------------------------------------------------
        async def update_cluster(admin_key: str | None) -> tuple[str, pd.DataFrame]:
            snapshot = await cluster.snapshot(admin_key)
            return snapshot.summary, pd.DataFrame(snapshot.rows, columns=COLUMNS)

        async def update_models(admin_key: str | None) -> str:
            return await handlers.models.listing(admin_key)

        cluster_io = dict(fn=update_cluster, inputs=[cluster_key], outputs=[cluster_summary, cluster_table],
                          show_progress="hidden")
        models_io = dict(fn=update_models, inputs=[cluster_key], outputs=[models_list],
                         show_progress="hidden")
        launch_button.click(handlers.models.launch, [
            cluster_key, launch_name, launch_path, launch_backend, launch_kv, launch_flags,
            launch_replicas, launch_on_demand, launch_keep_alive], models_result).then(**models_io)
        stop_button.click(handlers.models.stop, [cluster_key, stop_name], models_result).then(
            **models_io)
        cluster_refresh.click(**models_io)
        cluster_timer.tick(**models_io)
        cluster_tab.select(lambda: gr.Timer(active=True), None, cluster_timer, queue=False).then(
            **cluster_io)
        for other_tab in (chat_tab, arena_tab):
            other_tab.select(lambda: gr.Timer(active=False), None, cluster_timer, queue=False)
        cluster_refresh.click(**cluster_io)
        cluster_key.submit(**cluster_io)
        cluster_timer.tick(**cluster_io)
    return demo


def create_app(settings: WebUISettings, handlers: Handlers | None = None) -> FastAPI:
    """The web UI as an ASGI app: `GET /health` plus the Gradio page at `/`."""
    handlers = handlers or Handlers(settings)
    blocks = build_blocks(handlers)
    blocks.queue(default_concurrency_limit=settings.concurrency_limit)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await handlers.close()

    app = FastAPI(title="llmplatform web UI", lifespan=lifespan)
    app.state.settings = settings
    app.state.handlers = handlers
    app.state.blocks = blocks

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    app = gr.mount_gradio_app(
        app, blocks, path="",
        footer_links=[],            # no links to the API page or gradio.app
        allowed_paths=[],           # serve no file from disk beyond Gradio's own assets
        blocked_paths=[str(settings.log_dir.resolve())],
        max_file_size=1,            # bytes: Gradio's upload route stays open, but nothing fits
        show_error=False,           # an exception's text never reaches the page (the log has it)
        ssr_mode=False,             # no Node.js server
        mcp_server=False,
        pwa=False,
        enable_monitoring=False,
    )
    # Outermost, after Gradio's own: every route it mounted (its API, streams, assets) is behind it.
    app.add_middleware(PageGuard, allowed_hosts=settings.allowed_hosts)
    return app
