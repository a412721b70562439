"""Secrets reach the app as files (mounted Kubernetes Secrets): API keys and the cache
service's shared secret. Checked against a real cache-service process started the way the app
starts it, without Ray."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from pydantic import ValidationError

from cache_service.client import CacheClient, Unauthenticated
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from deployments.service.connection import cache_client_config
from deployments.service.host import CacheServiceProcess
from deployments.settings import AppSettings
from proto.contract import ConversationRef
from tests.cache_service.cs_helpers import History, commit_turn


def test_api_keys_file_adds_keys_and_turns_authentication_on(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("k-one\n\n  k-two  \n")
    settings = AppSettings(api_keys_file=str(keys), api_keys=("k-zero",))
    assert settings.auth_enabled
    assert settings.read_api_keys() == {"k-zero", "k-one", "k-two"}
    assert not AppSettings().auth_enabled and AppSettings().read_api_keys() == frozenset()
    keys.write_text("\n \n")
    with pytest.raises(ValueError, match="no key"):
        AppSettings(api_keys_file=str(keys)).read_api_keys()


def test_device_is_validated():
    assert AppSettings(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError):
        AppSettings(device="tpu")


async def test_the_started_cache_service_requires_the_shared_secret_from_the_file(tmp_path):
    secret = tmp_path / "cache-service-secret"
    secret.write_text("a-shared-secret-of-some-length\n")
    settings = AppSettings(cache_service_token_file=str(secret), data_dir=str(tmp_path / "data"))
    service = CacheServiceProcess(settings, "127.0.0.1")
    try:
        async with CacheClient(service.address, cache_client_config("test", settings)) as client:
            assert (await client.stats()).tier_budget_bytes > 0
        async with CacheClient(service.address, cache_client_config("test", AppSettings())) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.stats()
    finally:
        service.stop()


async def test_without_a_secret_file_the_started_cache_service_gets_a_random_secret(tmp_path):
    service = CacheServiceProcess(AppSettings(data_dir=str(tmp_path / "data")), "127.0.0.1")
    other = CacheServiceProcess(AppSettings(data_dir=str(tmp_path / "other")), "127.0.0.1")
    try:
        assert service.auth_token != other.auth_token
        async with CacheClient(service.address, cache_client_config("test", AppSettings(), service.auth_token)) as c:
            assert (await c.stats()).tier_budget_bytes > 0
        async with CacheClient(service.address, cache_client_config("test", AppSettings())) as anonymous:
            with pytest.raises(Unauthenticated):
                await anonymous.stats()
    finally:
        service.stop()
        other.stop()


async def test_the_started_cache_service_gets_the_redis_url_by_environment_not_on_its_argv(tmp_path):
    redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "redis"))
    redis.start()
    # A password Redis accepts (its default user has none: any is taken) and nobody may read in `ps`.
    url = redis.url.replace("redis://", "redis://default:a-redis-password@")
    service = CacheServiceProcess(AppSettings(redis_url=url, data_dir=str(tmp_path / "data")), "127.0.0.1")
    try:
        assert "a-redis-password" not in " ".join(psutil.Process(service.proc.pid).cmdline())
        assert not (tmp_path / "data" / "redis").exists(), "it started an embedded Redis instead"
        async with CacheClient(service.address, cache_client_config("test", AppSettings(), service.auth_token)) as c:
            assert (await c.stats()).tier_budget_bytes > 0  # it reads that Redis
    finally:
        service.stop()
        redis.stop()


async def test_the_started_cache_service_expires_conversations_after_conversation_ttl_s(tmp_path):
    settings = AppSettings(data_dir=str(tmp_path / "data"), conversation_ttl_s=1.0)
    assert settings.local_copy_ttl_s == 1.0  # the workers' copies never outlive the conversation
    assert AppSettings(conversation_ttl_s=0).local_copy_ttl_s == AppSettings().replica_copy_ttl_s
    service = CacheServiceProcess(settings, "127.0.0.1")
    try:
        async with CacheClient(service.address, cache_client_config("test", settings, service.auth_token)) as c:
            conv = ConversationRef("short-lived", salt="s")
            await commit_turn(c, conv, History(), [1, 2], "hello")

            async def expired() -> None:
                while await c.get_head_or_none(conv) is not None:
                    await asyncio.sleep(0.1)

            await asyncio.wait_for(expired(), 15.0)
    finally:
        service.stop()


def test_weight_quantization_is_validated_and_reaches_the_engine(tmp_path):
    from deployments.worker.engine_session import EngineSession
    from workers.checkpoint import Arch, Preset, make_model
    from workers.config import WeightQuantization

    with pytest.raises(ValidationError):
        AppSettings(weight_quantization="int4")
    with pytest.raises(ValidationError, match="cpu only"):
        AppSettings(weight_quantization="int8", device="cuda:0")
    model_dir = make_model(tmp_path / "model", Arch.BAMBA, Preset.TINY, seed=4)
    session = EngineSession(str(model_dir), AppSettings(weight_quantization="int8"))
    try:
        assert session.aengine.engine.config.weight_quantization is WeightQuantization.INT8
        assert "int8" in session.identity.dtype  # exports say so: no head moves to an fp32 replica
    finally:
        session.shutdown()


def test_the_dtype_follows_the_device_and_reaches_the_engine_config():
    """A replica on a GPU runs bf16 weights unless told otherwise; on CPU fp32 (its fast paths)."""
    import torch

    assert AppSettings().engine_config("m").dtype == torch.float32
    assert AppSettings(device="cuda").engine_config("m").dtype == torch.bfloat16
    assert AppSettings(device="cuda:1", dtype="float32").engine_config("m").dtype == torch.float32
    assert AppSettings(dtype="bfloat16").engine_config("m").dtype == torch.bfloat16
    with pytest.raises(ValidationError, match="float32 weights only"):
        AppSettings(weight_quantization="int8", dtype="bfloat16")
    with pytest.raises(ValidationError):
        AppSettings(dtype="float64")
