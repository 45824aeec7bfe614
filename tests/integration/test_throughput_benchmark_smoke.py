"""benchmarks/throughput.py --model, smoke-sized: ours and transformers' static batching on a tiny
Qwen3 checkpoint (any family the native engine runs). Checks what must hold whatever the timings:
every request gets exactly its output length from both systems, the same greedy tokens (float32
weights, bf16 products: the first tokens agree), and a ceiling only for dense SwiGLU models.
Never timings."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_throughput_benchmark_runs_a_local_model(tiny_qwen3_dir, tmp_path):
    bench = load_benchmark("throughput")
    out = tmp_path / "result.json"
    code = bench.main(["--model", str(tiny_qwen3_dir), "--num-requests", "3", "--prompt-len", "8,24",
                       "--output-len", "4,9", "--systems", "ours,hf-static,ceiling", "--kv-cache-memory", "64MiB",
                       "--ceiling-repeats", "1", "--json-out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["meta"]["model"] == tiny_qwen3_dir.name
    assert result["failures"] == {}
    ours, static = result["systems"]["ours"], result["systems"]["hf-static"]
    assert ours["output_tokens"] == static["output_tokens"] == result["meta"]["output_tokens"]
    assert 3 * 4 <= ours["output_tokens"] <= 3 * 9
    assert static["ours_over_system"] > 0 and result["ceilings"]


def test_the_ceiling_is_not_applicable_to_a_model_without_dense_swiglu_layers():
    bench = load_benchmark("throughput")

    class Layer:
        def __init__(self, mlp):
            self.mlp, self.self_attn = mlp, type("Attention", (), {"q_proj": None})()

    class Model:
        def __init__(self, mlp):
            self.model = type("Decoder", (), {"layers": [Layer(mlp)]})()

    assert bench.dense_swiglu(Model(type("MLP", (), {"gate_proj": None})()))
    assert not bench.dense_swiglu(Model(type("MoE", (), {"experts": None})()))
