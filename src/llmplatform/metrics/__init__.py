"""Prometheus metrics for every service (``GET /metrics``): one registry per app.

``common`` holds the route and shared buckets; ``worker``, ``gateway`` and ``controller`` each
define one service's series. Names and meanings are listed in docs/observability.md.
"""
