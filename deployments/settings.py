"""The application's arguments (`serve run deployments.app:build_app key=value ...` or the
`args:` block of config.yaml), validated once at build time and frozen.

Every deployment receives the same `AppSettings`; nothing below reads the environment.
"""

from __future__ import annotations

import enum
import hashlib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workers.quantization import WeightQuantization


class TierExport(str, enum.Enum):
    """When a worker copies a freshly committed head to the cache service's state tier."""

    ASYNC = "async"  # after the turn is answered (default): no latency, a small window without a copy
    SYNC = "sync"  # before the turn is answered: a killed owner never loses the head's state
    OFF = "off"  # never: a lost owner is recovered by recomputing from the ledger


class AppSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field("", description="checkpoint directory; empty: the built-in model, made on first run")
    cache_service: str = Field("", description="host:port of the cache service; empty: start one for the app")
    redis_url: str = Field("", description="Redis of the started cache service; empty: its embedded redis-server")
    data_dir: str = Field("data/serve", description="where a started cache service keeps Redis AOF and the tier")
    tier_export: TierExport = TierExport.ASYNC
    tier_export_delay_s: float = Field(
        0.5, ge=0, le=60, description="async export: how long a conversation must be quiet on its replica before its "
                                      "head goes to the tier (a next turn within it supersedes the head)")
    api_keys: tuple[str, ...] = Field((), description="bearer tokens; empty: no authentication")
    lease_ttl_s: float = Field(30.0, gt=0.05, le=3600)
    busy_wait_s: float = Field(30.0, ge=0, description="longest wait of a turn that asked to wait for its conversation")
    max_inflight: int = Field(64, ge=1, description="turns in flight at the ingress beyond which it answers 503")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request bodies beyond this get 413")
    forget_timeout_s: float = Field(
        5.0, gt=0, le=300, description="DELETE: longest wait for the owner replica to free its local copy "
                                       "(best effort: the answer is 200 either way, a stale copy is never used)")
    kv_cache_mb: int = Field(256, ge=1)
    head_cache_mb: int = Field(128, ge=1)
    max_model_len: int = Field(0, ge=0, description="0: the model's own limit")
    max_num_seqs: int = Field(16, ge=1)
    torch_threads: int = Field(1, ge=1, description="torch threads per worker replica")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where the engines run (cuda on GPU pods)")
    weight_quantization: WeightQuantization = Field(
        WeightQuantization.NONE, description="int8: weight-only int8 linears on CPU (faster decode, measured accuracy "
                                             "cost; see bench/results/engine.md); none: the weights as loaded")
    # Secrets come as files (mounted Kubernetes Secrets), read when a replica starts, so they
    # never appear in the application's config.
    api_keys_file: str = Field("", description="file of bearer tokens, one per line, added to api_keys")
    cache_service_token_file: str = Field("", description="file holding the cache service's shared secret")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):  # `serve run ... api_keys=k1,k2`
            return tuple(k for k in value.split(",") if k)
        return value

    @model_validator(mode="after")
    def _int8_on_cpu(self) -> AppSettings:
        # Refused here, at build time, rather than by every replica's engine at start-up.
        if self.weight_quantization is not WeightQuantization.NONE and self.device != "cpu":
            raise ValueError(f"weight_quantization={self.weight_quantization.value} runs on device cpu only")
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.api_keys_file)

    def read_api_keys(self) -> frozenset[str]:
        """api_keys plus the non-empty lines of api_keys_file (a missing file fails the start)."""
        keys = set(self.api_keys)
        if self.api_keys_file:
            keys.update(line.strip() for line in Path(self.api_keys_file).read_text().splitlines() if line.strip())
            if not keys:
                raise ValueError(f"api_keys_file {self.api_keys_file!r} holds no key")
        return frozenset(keys)

    def read_cache_service_token(self) -> str | None:
        if not self.cache_service_token_file:
            return None
        token = Path(self.cache_service_token_file).read_text().strip()
        if not token:
            raise ValueError(f"cache_service_token_file {self.cache_service_token_file!r} is empty")
        return token

    @staticmethod
    def key_scope(api_key: str | None) -> str:
        """A short, stable name of an API key, prefixed to cache salts when auth is on."""
        if not api_key:
            return ""
        return hashlib.sha256(api_key.encode()).hexdigest()[:16]
