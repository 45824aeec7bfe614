"""serve --ray's pure parts: the bare flag, where each service's actor goes and what it binds,
and the message without Ray installed. The Ray run itself: tests/integration/test_serve_ray.py."""

from __future__ import annotations

import sys

import pytest

from llmplatform.serve.launcher import ClusterSpec, _bare_ray_flag, services_for
from llmplatform.serve.ray_launcher import (
    MISSING_RAY, controller_for_workers, on_node, placements, run_on_ray, worker_resources,
    workers_reach_controller)


def test_bare_ray_flag_means_a_local_instance():
    assert _bare_ray_flag(["--ray"]) == ["--ray", "local"]
    assert _bare_ray_flag(["--ray", "--no-webui"]) == ["--ray", "local", "--no-webui"]
    assert _bare_ray_flag(["--ray", "auto", "--no-webui"]) == ["--ray", "auto", "--no-webui"]
    assert _bare_ray_flag(["--ray=10.0.0.1:6379"]) == ["--ray=10.0.0.1:6379"]


def cluster(host: str) -> list:
    spec = ClusterSpec(host=host, workers=[["--port", "9001"], ["--device", "cpu"]], webui=False,
                       cluster_secret="s3cret")
    return services_for(spec)


def test_loopback_keeps_everything_on_serves_node():
    services = cluster("127.0.0.1")
    places = placements(services, host="127.0.0.1", user_worker_addresses=[False, False],
                        cluster_has_gpus=True)
    assert [p.pin_to_driver_node for p in places] == [True, True, True, True]
    assert [(p.num_cpus, p.num_gpus) for p in places] == [(0, 0), (1, 1), (1, 0), (0, 0)]
    argv, health = on_node(services[1], places[1], "10.0.0.7")
    assert argv[1:] == services[1].argv[1:] and health == "http://127.0.0.1:9001/health"


def test_workers_elsewhere_bind_and_advertise_their_node():
    services = cluster("0.0.0.0")
    workers_reach_controller(services, host="0.0.0.0", driver_ip="10.0.0.1")
    places = placements(services, host="0.0.0.0", user_worker_addresses=[False, True],
                        cluster_has_gpus=False)
    assert [p.pin_to_driver_node for p in places] == [True, False, False, True]
    argv, health = on_node(services[1], places[1], "10.0.0.7")
    flags = dict(zip(argv, argv[1:]))
    assert flags["--host"] == "0.0.0.0" and flags["--worker-address"] == "http://10.0.0.7:9001"
    assert flags["--controller-address"] == "http://10.0.0.1:21001"
    assert health == "http://10.0.0.7:9001/health"
    assert "s3cret" not in argv and services[1].env  # the secret travels in the environment
    api_flags = dict(zip(services[-1].argv, services[-1].argv[1:]))
    assert api_flags["--controller-address"] == "http://127.0.0.1:21001"  # same node


def test_a_launched_workers_resources_read_its_flags_in_either_form(monkeypatch):
    monkeypatch.delenv("LLMPLATFORM_DEVICE", raising=False)
    monkeypatch.delenv("LLMPLATFORM_TENSOR_PARALLEL_SIZE", raising=False)
    assert worker_resources(["--dtype", "float32"], has_gpus=True) == (1, 1)
    assert worker_resources(["--device=cpu"], has_gpus=True) == (1, 0)
    assert worker_resources(["--device", "cuda", "--tensor-parallel-size=2"],
                            has_gpus=False) == (2, 2)
    monkeypatch.setenv("LLMPLATFORM_DEVICE", "cpu")  # serve's environment reaches every node
    assert worker_resources([], has_gpus=True) == (1, 0)
    assert controller_for_workers("http://127.0.0.1:21001", host="0.0.0.0",
                                  driver_ip="10.0.0.1") == "http://10.0.0.1:21001"
    assert controller_for_workers("http://127.0.0.1:21001", host="127.0.0.1",
                                  driver_ip="10.0.0.1") == "http://127.0.0.1:21001"


def test_without_ray_the_message_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SystemExit, match=r"llmplatform\[ray\]") as exc:
        run_on_ray("local", [], None, [], None)  # type: ignore[arg-type]
    assert str(exc.value) == MISSING_RAY


def test_a_token_file_others_can_read_is_tightened(tmp_path, monkeypatch):
    from llmplatform.serve.ray_local import tighten_token_file

    token = tmp_path / "auth_token"
    token.write_text("t" * 64)
    token.chmod(0o644)  # what Ray leaves under a 022 umask
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    tighten_token_file()
    assert token.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "absent"))
    tighten_token_file()  # nothing to do, no error


def test_a_local_rays_folders_are_tightened_and_removed(monkeypatch):
    from llmplatform.serve.ray_local import LocalRay

    local = LocalRay("127.0.0.1")
    try:
        assert local.directory.stat().st_mode & 0o777 == 0o700
        session = local.directory / "ray" / "session_x" / "logs"
        session.mkdir(parents=True)
        for folder in (session, session.parent, session.parent.parent):
            folder.chmod(0o777)  # what Ray's try_make_directory_shared does
        local.tighten()
        assert {oct(p.stat().st_mode & 0o777) for p in local.directory.rglob("*")} == {"0o700"}
    finally:
        local.close()
    assert not local.directory.exists()
