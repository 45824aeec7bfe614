"""serve --ray reserves a tensor-parallel worker's ranks: one actor holding N CPUs (N GPUs on
CUDA), so Ray places all of them on one node."""

from __future__ import annotations

from llmplatform.serve.launcher import ClusterSpec, services_for
from llmplatform.serve.ray_launcher import placements


def test_a_tensor_parallel_worker_reserves_one_cpu_or_gpu_per_rank():
    spec = ClusterSpec(host="127.0.0.1", webui=False, workers=[
        ["--tensor-parallel-size", "2", "--device", "cpu"], ["--tensor-parallel-size", "4"], []])
    places = placements(services_for(spec), host="127.0.0.1",
                        user_worker_addresses=[False, False, False], cluster_has_gpus=True)
    workers = [(p.num_cpus, p.num_gpus) for p in places[1:4]]
    assert workers == [(2, 0), (4, 4), (1, 1)]
