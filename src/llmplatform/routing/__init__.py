"""Routing: which worker serves the next request. Pure code (no HTTP, clock injected), below the
services: a gateway's router and the controller's (for the gateways that ask it) are the same
:class:`~llmplatform.routing.router.Router`.

prefix_tree.py: route hints and the per-worker prefix trees cache_aware matches;
cache_aware.py: the cache_aware policy; policies.py: the dispatch methods; load.py: the one load
estimate; router.py: the table of workers those run over, with its mark-down rules.
"""
