"""The soak's plans, the stack it runs on, and the workload with its Redis sampler."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai
import ray
import redis.asyncio as aioredis
from ray import serve
from tqdm import tqdm

from bench.kit.chat_text import chat_text
from bench.kit.environment import environment_info
from bench.kit.servers import free_port
from cache_service.client import CacheClient
from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from cache_service.keys import ConversationKeys
from deployments.app import build_app
from proto.contract import ConversationRef
from tests.cache_service.cs_helpers import ServiceProcess
from workers.checkpoint import Arch, Preset, make_model
from workers.checkpoint.builtin import builtin_model_dir

APP = "hybridserve-soak"
SALT = "soak"


@dataclass(frozen=True)
class SoakPlan:
    responses: int  # stateless Responses calls: each stores a one-turn conversation (store defaults to true)
    conversations: int  # two-turn chat conversations, never used again
    live: int  # conversations kept alive by a turn every ttl_s / 4 for the whole run
    ttl_s: float  # the conversation TTL of the run (the prefix index's too, so it is bounded alike)
    builtin_model: bool = True  # the built-in model; False: the tiny test checkpoint
    concurrency: int = 8
    max_tokens: int = 2  # tiny replies: the soak is about storage, not compute
    lease_ttl_s: float = 5.0
    sample_every_s: float = 0.5
    measure_every: int = 50  # the MEMORY USAGE of every n-th stored conversation's keys is measured
    seed: int = 0
    # A live conversation moves on to a new one after this many turns (the old one then expires):
    # a chat that outgrows the model's context is refused, not stored.
    live_turns_each: int = 30


FULL = SoakPlan(responses=5000, conversations=2000, live=8, ttl_s=20.0)
SMOKE = SoakPlan(responses=24, conversations=12, live=2, ttl_s=3.0, builtin_model=False, lease_ttl_s=2.0,
                 measure_every=6, live_turns_each=3)


@dataclass
class Sample:
    t: float  # seconds since the load started (negative: before)
    used_memory: int
    keys: int
    tier_entries: int | None


@dataclass
class Observed:
    samples: list[Sample] = field(default_factory=list)
    last_use: dict[str, float] = field(default_factory=dict)  # conversation -> its last turn's end (load clock)
    conversation_bytes: list[int] = field(default_factory=list)  # MEMORY USAGE of one conversation's keys
    errors: dict[str, int] = field(default_factory=dict)
    live_turns: list[dict] = field(default_factory=list)  # {conversation, turn, expected, cached_tokens}
    live_ledgers: dict[str, int] = field(default_factory=dict)  # GET /v1/conversations at the end: turns
    live_bytes_max: int = 0  # the most the live conversations' own keys held at once (their ledgers grow)
    load_end_s: float = 0.0
    end_s: float = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class Soak:
    def __init__(self, plan: SoakPlan, base_url: str, redis_url: str, service_target: str):
        self.plan, self.base_url, self.redis_url, self.service_target = plan, base_url, redis_url, service_target
        self.seen = Observed()
        self.rng = random.Random(plan.seed)
        self.t0 = time.monotonic()
        self.model = ""
        self._done = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> Observed:
        # Made on the run's event loop (gRPC's and Redis's clients bind to it).
        self.redis = aioredis.Redis.from_url(self.redis_url)
        self.cache = CacheClient(self.service_target)
        self.client = openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                                         timeout=120)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60) as http:
            self.model = (await http.get("/v1/models")).json()["data"][0]["id"]
        stop = asyncio.Event()
        self.t0 = time.monotonic() + 2 * self.plan.sample_every_s  # the baseline is sampled first
        sampler = asyncio.create_task(self._sample(stop))
        await asyncio.sleep(max(0.0, -self.now()))
        self.live_now = [f"live-{k}-0" for k in range(self.plan.live)]  # each live conversation's current id
        self.live_bytes = [0] * self.plan.live
        live = [asyncio.create_task(self._live(k, stop)) for k in range(self.plan.live)]
        await self._load()
        self.seen.load_end_s = self.now()
        # Past the TTL after the last stored call: everything but the live conversations expired.
        await asyncio.sleep(self.plan.ttl_s + self.plan.lease_ttl_s + 2.0)
        stop.set()
        await asyncio.gather(sampler, *live)
        self.seen.end_s = self.now()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60) as http:
            for conv in self.live_now:
                got = await http.get(f"/v1/conversations/{conv}", params={"cache_salt": SALT})
                self.seen.live_ledgers[conv] = got.json()["turn"] if got.status_code == 200 else 0
        await self.redis.aclose()
        await self.cache.close()
        return self.seen

    async def _load(self) -> None:
        jobs = [("responses", i) for i in range(self.plan.responses)]
        jobs += [("conversation", i) for i in range(self.plan.conversations)]
        self.rng.shuffle(jobs)
        queue: asyncio.Queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        with tqdm(total=len(jobs), desc="soak", unit="call") as bar:
            async def worker() -> None:
                while not queue.empty():
                    kind, index = queue.get_nowait()
                    try:
                        conv = await (self._responses(index) if kind == "responses" else self._conversation(index))
                        self.seen.last_use[conv] = self.now()
                        self._done += 1
                        if self._done % self.plan.measure_every == 0:
                            await self._measure(conv)
                    except (openai.APIError, httpx.HTTPError) as e:
                        self.seen.error(f"{kind}: {type(e).__name__} {getattr(e, 'status_code', '')}".strip())
                    bar.update(1)

            await asyncio.gather(*(worker() for _ in range(self.plan.concurrency)))

    def _text(self, lead: str) -> str:
        return chat_text(self.rng, 48, lead)

    async def _responses(self, index: int) -> str:
        """A client that resends its history without previous_response_id: a new stored conversation."""
        history = [{"role": "user", "content": self._text(f"r{index}")},
                   {"role": "assistant", "content": self._text("ok")},
                   {"role": "user", "content": self._text("and")}]
        r = await self.client.responses.create(model=self.model, input=history, max_output_tokens=self.plan.max_tokens,
                                               temperature=0, extra_body={"cache_salt": SALT})
        return r.conversation.id

    async def _turn(self, conv: str, text: str) -> dict:
        r = await self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": text}], max_tokens=self.plan.max_tokens,
            temperature=0, extra_body={"conversation_id": conv, "cache_salt": SALT})
        details = r.usage.prompt_tokens_details
        return {"turn": r.model_extra["turn"], "cached_tokens": details.cached_tokens if details else 0}

    async def _conversation(self, index: int) -> str:
        conv = f"short-{index}"
        for expected in (1, 2):
            turn = await self._turn(conv, self._text(f"c{index}"))
            if turn["turn"] != expected:
                self.seen.error("conversation: wrong turn")
        return conv

    async def _live(self, k: int, stop: asyncio.Event) -> None:
        """A conversation in use all along: each turn must continue the ledger (nothing expired).
        After `live_turns_each` turns it moves on to a new conversation, as a chat that outgrew
        the context would."""
        generation, expected = 0, 1
        while True:
            if expected > self.plan.live_turns_each:  # the old one is stored, unused from now: it expires
                self.seen.last_use[self.live_now[k]] = self.now()
                generation, expected = generation + 1, 1
                self.live_now[k] = f"live-{k}-{generation}"
            conv = self.live_now[k]
            try:
                turn = await self._turn(conv, self._text(f"l{k}"))
                self.seen.live_turns.append({"conversation": conv, "expected": expected, **turn})
                expected = turn["turn"] + 1
                self.live_bytes[k] = await self._bytes_of(conv)
                self.seen.live_bytes_max = max(self.seen.live_bytes_max, sum(self.live_bytes))
            except (openai.APIError, httpx.HTTPError) as e:
                self.seen.error(f"live: {type(e).__name__} {getattr(e, 'status_code', '')}".strip())
            try:
                await asyncio.wait_for(stop.wait(), self.plan.ttl_s / 4)
                return
            except TimeoutError:
                pass

    async def _bytes_of(self, conv: str) -> int:
        keys = ConversationKeys.of(ConversationRef(conv, salt=SALT))
        return sum([await self.redis.memory_usage(key, samples=0) or 0
                    for key in (keys.head, keys.ledger, keys.marks, keys.fence)])

    async def _measure(self, conv: str) -> None:
        keys = ConversationKeys.of(ConversationRef(conv, salt=SALT))
        sizes = [await self.redis.memory_usage(key, samples=0) for key in (keys.head, keys.ledger, keys.marks,
                                                                            keys.fence)]
        if all(sizes):  # all four still there (none expired meanwhile)
            self.seen.conversation_bytes.append(sum(sizes))

    async def _sample(self, stop: asyncio.Event) -> None:
        tick = 0
        while not stop.is_set():
            info = await self.redis.info("memory")
            keys = await self.redis.dbsize()
            tier = (await self.cache.stats()).tier_entries if tick % 4 == 0 else None
            self.seen.samples.append(Sample(round(self.now(), 3), int(info["used_memory"]), int(keys), tier))
            tick += 1
            try:
                await asyncio.wait_for(stop.wait(), self.plan.sample_every_s)
            except TimeoutError:
                pass


def _model(plan: SoakPlan, root: Path) -> Path:
    if plan.builtin_model:
        return builtin_model_dir()
    return make_model(root / "model", Arch.BAMBA, Preset.TINY, seed=4)


def run(plan: SoakPlan) -> dict:
    """The stack (Redis, a cache service with the plan's TTL, the app), the soak, and what it saw."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as cleanup:
        root = Path(tmp)
        model_dir = _model(plan, root)
        redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=root / "redis", fsync=FsyncPolicy.ALWAYS))
        cleanup.callback(redis.stop)
        redis.start()
        ttl = str(plan.ttl_s)
        service = ServiceProcess(data_dir=root / "service", redis_url=redis.url, extra_env={
            "CACHE_CONVERSATION_TTL_S": ttl, "CACHE_PREFIX_TTL_S": ttl,
            "CACHE_TIER_SWEEP_INTERVAL_S": str(plan.ttl_s / 4)})
        cleanup.callback(service.close)
        service.start()
        port = free_port()
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}})
        cleanup.callback(ray.shutdown)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cleanup.callback(serve.shutdown)
        args = {"model": str(model_dir), "cache_service": service.target, "conversation_ttl_s": plan.ttl_s,
                "lease_ttl_s": plan.lease_ttl_s, "max_num_seqs": 8, "tier_export": "async"}
        serve.run(build_app(args), name=APP, route_prefix="/")
        seen = asyncio.run(Soak(plan, f"http://127.0.0.1:{port}", redis.url, service.target).run())
    return {"plan": asdict(plan), "observed": asdict(seen), "environment": environment_info()}
