"""benchmarks/gpu_decode.py --smoke: the three systems and the decode-step floor on a tiny random
Llama, on whatever device the test has (CPU here: no graphs, and the table says why). Checks what
must hold whatever the timings: every system produced every token, the ratios are computed against
transformers, the floor comes from the weights' bytes and a measured bandwidth. Never timings."""

from __future__ import annotations

import json

from tests.benchmark_scripts import load_benchmark


def test_gpu_decode_benchmark_smoke(tmp_path, capsys):
    bench = load_benchmark("gpu_decode")
    out = tmp_path / "result.json"
    assert bench.main(["--smoke", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["smoke"] and result["streams"] == [1, 3]
    for system in ("ours_graphs", "ours_eager", "transformers"):
        assert set(result["tokens_per_s"][system]) == {"1", "3"}
        assert all(v > 0 for v in result["tokens_per_s"][system].values())
    if result["device"] == "cpu":
        assert result["graphs"] is None and "CUDA" in result["graphs_off"]
    else:
        assert result["graphs"][:3] == [1, 2, 4]
    # The tiny shape's weights (tied embedding once), in float32 on CPU.
    shape = bench.TINY
    per_layer = (shape["hidden_size"] * shape["head_dim"] * (shape["num_attention_heads"]
                 + 2 * shape["num_key_value_heads"]) + shape["num_attention_heads"] * shape["head_dim"]
                 * shape["hidden_size"] + 3 * shape["hidden_size"] * shape["intermediate_size"]
                 + 2 * shape["hidden_size"])
    params = shape["num_hidden_layers"] * per_layer + shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"]
    assert result["parameters"] == params
    if result["dtype"] == "float32":
        assert result["weight_bytes"] == 4 * params
    assert result["floor_s"] == result["weight_bytes"] / (result["copy_bandwidth_gbps"] * 1e9)
    assert result["step_s"]["ours_graphs"] > 0 and result["step_s"]["ours_eager"] > 0
    table = capsys.readouterr().out
    assert "transformers generate" in table and "x floor" in table and "1.00x" in table
