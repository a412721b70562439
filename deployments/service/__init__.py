"""Reaching the cache service (one client per process, every process of the app) or hosting it
(the CacheService deployment that runs `python -m cache_service` as a child)."""
