"""`serve run deployments.app:build_app model=DIR` (or `serve run config.yaml`): the graph.

    ChatIngress ──(StickyConversationRouter)──> Worker x N ──gRPC──> cache service
         └──────────────────gRPC (leases, heads, ledger)────────────────┘
    CacheService: only when no `cache_service` address is given; it runs
    `python -m cache_service` (with its embedded Redis unless `redis_url`) for the app.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.service.host import CacheService
from deployments.front.ingress import ChatIngress
from deployments.settings import AppSettings
from deployments.worker.replica import Worker


def build_app(args: dict[str, Any]) -> Application:
    settings = AppSettings.model_validate(args)
    cache = None if settings.cache_service else CacheService.bind(settings)
    workers = Worker.bind(settings, cache)
    return ChatIngress.bind(settings, workers, cache)


def app_names() -> list[str]:
    """The deployments build_app makes, for the config checks of config.yaml and k8s/."""
    return [ChatIngress.name, Worker.name, CacheService.name]

