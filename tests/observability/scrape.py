"""Scraping a real /metrics endpoint with Prometheus' own text parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def scrape(base_url: str) -> Samples:
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample's value, None when the series is absent."""
    return samples.get((name, frozenset(labels.items())))


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return (value(after, name, **labels) or 0.0) - (value(before, name, **labels) or 0.0)

