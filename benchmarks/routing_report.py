"""benchmarks/routing.py's report: the tables (the default pool; the cache-bound pass) and the
ratios to least_load."""

from __future__ import annotations

import os
from typing import Any


def _shared_cells(s: dict[str, Any] | None, ideal: float) -> str:
    if not s:
        return " | ".join(["-"] * 6)
    of_ideal = f"{s['hit_rate'] / ideal:.1%}" if ideal else "-"
    return (f"{s['hit_rate']:.1%} | {of_ideal} | {s['ttft_p50_s']:.2f} | "
            f"{s['ttft_mean_s']:.2f} | {s['ttft_p99_s']:.2f} | {s['output_tok_s']:.1f}")


def report(results: dict[str, dict[str, Any]], ideal: float, bound: dict[str, Any] | None) -> dict[str, Any]:
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")
    print("\n| policy | shared: hit rate | of ideal | TTFT p50 s | TTFT mean s | TTFT p99 s | output tok/s "
          "| skewed: max worker share of requests (of computed prompt tokens) | unshared: output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        k, u = r.get("skewed"), r.get("unshared")
        skewed = f"{k['max_worker_share']:.1%} ({k['max_worker_computed_share']:.1%})" if k else "-"
        unshared = f"{u['output_tok_s']:.1f}" if u else "-"
        print(f"| {policy} | {_shared_cells(r.get('shared'), ideal)} | {skewed} | {unshared} |")
    if bound is not None:
        fraction = (f"{bound['pool_blocks'] / bound['working_set_blocks']:.0%}"
                    if bound["working_set_blocks"] else "all")
        print(f"\ncache-bound (shared_bound): each worker's KV pool {bound['pool_blocks']} blocks "
              f"({bound['pool_mib']:.0f} MiB), {fraction} of the shared prompts' {bound['working_set_blocks']} "
              f"blocks ({bound['working_set_mib']:.0f} MiB)")
        print("\n| policy | shared_bound: hit rate | of ideal | TTFT p50 s | TTFT mean s | TTFT p99 s | output tok/s |")
        print("|---|---|---|---|---|---|---|")
        for policy, r in results.items():
            if "shared_bound" in r:
                print(f"| {policy} | {_shared_cells(r['shared_bound'], ideal)} |")
    print(f"\nsingle-worker ideal hit rate (shared): {ideal:.1%}")
    ratios: dict[str, Any] = {}
    base = results.get("least_load", {})
    for policy, r in results.items():
        entry: dict[str, Any] = {}
        for workload, tag in (("shared", ""), ("shared_bound", "bound_")):
            if workload not in r:
                continue
            entry[f"{tag}hit_rate_of_ideal"] = round(r[workload]["hit_rate"] / ideal, 3) if ideal else None
            if policy != "least_load" and workload in base:
                mine, theirs = r[workload], base[workload]
                entry[f"{tag}ttft_p50_least_load_over_this"] = round(theirs["ttft_p50_s"] / mine["ttft_p50_s"], 2)
                entry[f"{tag}ttft_mean_least_load_over_this"] = round(theirs["ttft_mean_s"] / mine["ttft_mean_s"], 2)
                entry[f"{tag}throughput_over_least_load"] = round(mine["output_tok_s"] / theirs["output_tok_s"], 2)
        if "skewed" in r:
            entry["skewed_max_worker_share"] = r["skewed"]["max_worker_share"]
            entry["skewed_max_worker_computed_share"] = r["skewed"]["max_worker_computed_share"]
        if policy != "least_load" and "unshared" in r and "unshared" in base:
            entry["unshared_throughput_over_least_load"] = round(
                r["unshared"]["output_tok_s"] / base["unshared"]["output_tok_s"], 3)
        ratios[policy] = entry
    for policy, entry in ratios.items():
        print(f"{policy}: " + ", ".join(f"{k} {v}" for k, v in entry.items()))
    return ratios
