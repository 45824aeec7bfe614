"""The Cluster tab's launch and stop controls (`webui.model_controls`) against a real controller,
gateway and host agent (tests/integration/test_model_lifecycle.py's): what the visitor reads for
a launch, a refusal, a key that is not an admin key, a stop. On-demand launches only: no worker
process starts."""

from __future__ import annotations

from llmplatform.webui.model_controls import ModelControls
from llmplatform.webui.settings import WebUISettings
from tests.integration.test_model_lifecycle import ADMIN, USER, runtime


async def test_launch_list_and_stop_from_the_cluster_tab(tmp_path, tiny_model_dir):
    with runtime(tmp_path) as rt:
        controls = ModelControls(WebUISettings(api_base=f"{rt.gateway_url}/v1"))
        try:
            launch = dict(name="lazy", model_path=str(tiny_model_dir), backend="paged",
                          kv_cache_memory="64MiB", worker_flags="--dtype float32",
                          replicas=1, on_demand=True, keep_alive=60)
            assert await controls.launch(ADMIN, **launch) == "**lazy**: not_loaded"
            assert await controls.listing(ADMIN) == "- **lazy**: not_loaded (on demand)"

            refused = await controls.launch(ADMIN, **{**launch, "name": "other",
                                                     "model_path": str(tmp_path / "nowhere")})
            assert refused.startswith("**Not launched:** HTTP 400: ") and "nowhere" in refused
            assert (await controls.launch(ADMIN, **{**launch, "worker_flags": "'unclosed"})
                    ).startswith("**Not launched:** worker flags:")
            assert (await controls.launch(USER, **{**launch, "name": "x"})).startswith(
                "**Not launched:** HTTP 403: ")
            assert (await controls.stop(USER, "lazy")).startswith("**Not stopped:** HTTP 403: ")
            assert (await controls.stop(ADMIN, "nothing")).startswith("**Not stopped:** HTTP 404: ")

            assert await controls.stop(ADMIN, "lazy") == "**lazy**: not_loaded"
            assert await controls.listing(ADMIN) == "No models."
        finally:
            await controls.close()
