"""The OpenAI-compatible HTTP front (FastAPI through `@serve.ingress`).

    POST   /v1/chat/completions        stateless, or a conversation turn (see turn/run.py)
    POST   /v1/responses               OpenAI's Responses API on conversations (see responses_plan.py)
    GET    /v1/responses/{id}[/input_items], DELETE /v1/responses/{id}
    POST   /v1/conversations           a fresh conversation id (stored with its first response)
    GET    /v1/models
    GET    /v1/conversations/{id}      ledger and head (cache_salt query parameter required)
    DELETE /v1/conversations/{id}      drops the head, the ledger, the tier copy and the owner's local copy
    GET    /health, /metrics

With API keys configured every /v1 route wants `Authorization: Bearer KEY`, and the key's
scope is prefixed to the cache salt: another key never sees a conversation's state.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Receive, Scope, Send

from cache_service.client import CacheClient, CacheError, LeaseHeld, NotFound
from deployments import errors
from deployments.front import responses_plan
from deployments.front.chat_models import CacheSalt, ChatCompletionRequest
from deployments.front.guard import BodyLimit
from deployments.service.connection import CacheConnection
from deployments.errors import APIError
from deployments.turn.lease_keeper import LeaseKeeper
from deployments.front.metrics import ServeMetrics
from deployments.front.chat_format import ChatFormat
from deployments.messages import HeadRef, Recovery, ReplicaCall, TurnDelta, TurnDone, TurnEvent, TurnFailed
from deployments.front.responses_plan import HeadMoved
from deployments.front.responses_format import ResponseStream
from deployments.front.responses_models import ConversationCreate, ResponsesRequest
from deployments.settings import AppSettings
from deployments.turn.outcome import IdempotencyKey
from deployments.turn.run import TurnRun, first_error
from proto.contract import ConversationRef

DEFAULT_MAX_TOKENS = 256
STATS_SCRAPE_S = 0.5  # the longest a /metrics scrape waits for the cache service's index size
log = logging.getLogger("hybridserve.ingress")
api = FastAPI(title="hybridserve", version="0.1.0",
              description="OpenAI-compatible chat completions with conversation state kept between turns")
errors.install(api)


class _Guard:
    """Before the body is read: 401 without a configured API key (every /v1 route), 413 over the
    size limit. Both limits are the deployment's, set on the app in ChatIngress.__init__.
    Pure ASGI, not `@api.middleware("http")`: that one passes every response chunk (each SSE
    token) through an extra task and memory stream."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = _refusal(Request(scope))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(request: Request) -> APIError | None:
    state = request.app.state  # the deployment's copy of `api` that serves the request, not this module's
    keys = getattr(state, "api_keys", ())
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))  # the app's own route
    if keys and path.startswith("/v1/") and _bearer(request) not in keys:
        return APIError(401, "invalid or missing API key", "invalid_api_key")
    limit = getattr(state, "max_body_bytes", None)
    size = request.headers.get("content-length", "")
    if limit is not None and size.isdigit() and int(size) > limit:
        return APIError(413, f"request body over {limit} bytes", "request_too_large")
    return None


api.add_middleware(_Guard)
api.add_middleware(BodyLimit)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    return header[len("Bearer "):] if header.startswith("Bearer ") else ""


def _model_name(settings: AppSettings) -> str:
    return Path(settings.model).name if settings.model else "hybridserve-builtin"


def _check_id(conversation_id: str) -> None:
    if not 0 < len(conversation_id.encode()) <= 256:
        raise APIError(400, "conversation_id must be 1..256 bytes", "invalid_request", param="conversation_id")


class EventStream(Protocol):
    """How a streamed turn is rendered: its SSE chunks at the start, per delta, at the end or
    on a failure."""

    def start(self) -> Iterable[str]: ...
    def delta(self, delta: TurnDelta) -> Iterable[str]: ...
    def end(self, done: TurnDone) -> Iterable[str]: ...
    def error(self, error: APIError) -> Iterable[str]: ...


@dataclass(frozen=True)
class _ChatStream:
    """A chat completion's chunks (chat_format.ChatFormat) as an EventStream."""

    form: ChatFormat
    include_usage: bool

    def start(self) -> Iterable[str]:
        return [self.form.sse_start()]

    def delta(self, delta: TurnDelta) -> Iterable[str]:
        return [self.form.sse_delta(delta)]

    def end(self, done: TurnDone) -> Iterable[str]:
        return self.form.sse_end(done, self.include_usage)

    def error(self, error: APIError) -> Iterable[str]:
        return [self.form.sse_error(error)]


class _ClosingStream(StreamingResponse):
    """A stream whose body generator is closed however the response ends. Starlette leaves it
    suspended at its last `yield` when the client hangs up, to be closed whenever the garbage
    collector gets to it; its `finally` settles the turn (cancels the worker's run, discards the
    lease) and the ingress's in-flight count, which cannot wait that long."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self.body_iterator.aclose())


def _idempotency(request: Request, body: ChatCompletionRequest) -> IdempotencyKey | None:
    """The request's Idempotency-Key, bound to its body (the parts that change the turn)."""
    key = request.headers.get("idempotency-key")
    if key is None or body.conversation_id is None:
        return None
    if not 0 < len(key.encode()) <= 256:
        raise APIError(400, "Idempotency-Key must be 1..256 bytes", "invalid_request", param="Idempotency-Key")
    return IdempotencyKey.of(key, body.model_dump(exclude={"stream", "stream_options", "wait_if_busy"}))


def _unknown(conversation_id: str) -> APIError:
    return APIError(404, f"no conversation {conversation_id!r} under this cache_salt", "conversation_not_found")


@serve.deployment(name="ChatIngress", num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class ChatIngress:
    def __init__(self, settings: AppSettings, workers: DeploymentHandle, cache_host: DeploymentHandle | None):
        self.settings = settings
        self.workers = workers
        self.cache_host = cache_host
        self.model = _model_name(settings)
        self.metrics = ServeMetrics()
        self._keeper: LeaseKeeper | None = None  # made with the connection's client
        self._connection = CacheConnection(settings, cache_host, "ingress", self._connected)
        self._inflight = 0
        api.state.max_body_bytes = settings.max_body_bytes
        api.state.api_keys = settings.read_api_keys()

    async def _cache(self) -> CacheClient:
        return await self._connection.get()

    def _connected(self, client: CacheClient) -> None:
        self._keeper = LeaseKeeper(client.target, client.config, on_delay=self.metrics.lease_renewal_delay)

    def _scope(self, request: Request, cache_salt: str) -> str:
        """The caller's cache scope: its salt, scoped to its API key when authentication is on
        (checked by _guard)."""
        if self.settings.auth_enabled:
            return f"{AppSettings.key_scope(_bearer(request))}:{cache_salt}"
        return cache_salt

    def _conversation(self, request: Request, conversation_id: str, cache_salt: str) -> ConversationRef:
        """The caller's conversation, named in its cache scope."""
        return ConversationRef(conversation_id, self._scope(request, cache_salt))

    # -- chat ------------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrived = time.monotonic()
        conv = None if body.conversation_id is None else self._conversation(request, body.conversation_id,
                                                                            body.cache_salt)
        self._check_model(body.model)
        run, first, events = await self._start_turn(lambda: dict(
            messages=[m.as_engine_message() for m in body.messages],
            sampling=body.sampling(DEFAULT_MAX_TOKENS), conversation=conv,
            scope=self._scope(request, body.cache_salt),
            wait_if_busy=body.wait_if_busy, idempotency=_idempotency(request, body),
            tools=body.engine_tools(), parse_tool_calls=body.calls_tools))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _ChatStream(self._format(body, run), include_usage)
            return _ClosingStream(self._relay(run, first, events, arrived, stream), media_type="text/event-stream")
        return await self._complete(body, run, first, events, arrived)

    def _check_model(self, model: str) -> None:
        if model != self.model:
            raise APIError(404, f"model {model!r} does not exist; this server has {self.model!r}",
                           "model_not_found", param="model")

    async def _start_turn(self, start: Callable[[], dict[str, Any]], *, expect_turn: int | None = None,
                          ) -> tuple[TurnRun, TurnEvent, AsyncIterator[TurnEvent]]:
        """Count the request in, start its turn (`start()`: TurnRun.start's arguments, made once
        the request is counted: a bad one is a counted 4xx) and wait for its first event; a failure
        before that is raised (and counted). `expect_turn`: the head turn the conversation must be
        at under the turn's lease, else HeadMoved (the request not counted)."""
        if self._inflight >= self.settings.max_inflight:
            raise errors.overloaded("too many requests in flight")
        self._inflight += 1
        self.metrics.queue_depth.inc()
        try:
            run = await TurnRun.start(self.settings, self.workers, await self._cache(), self._keeper, **start())
        except BaseException as e:
            self._finished(e.status if isinstance(e, APIError) else 500)
            if isinstance(e, APIError) and e.code == "conversation_busy":
                self.metrics.lease_conflicts.inc()
            raise
        if expect_turn is not None and (run.job.head.turn if run.job.head else 0) != expect_turn:
            self._inflight -= 1
            self.metrics.queue_depth.dec()
            await run.close()
            raise HeadMoved()
        events = run.events()
        try:
            first = await anext(events)
        except BaseException as e:
            await run.close()
            self._finished(e.status if isinstance(e, APIError) else 500)
            raise
        error = first_error(first)
        if error is not None:
            await run.close()
            self._finished(error.status)
            raise error
        return run, first, events

    def _finished(self, status: int) -> None:
        self._inflight -= 1
        self.metrics.queue_depth.dec()
        self.metrics.requests.labels(str(status)).inc()

    def _observe(self, event, arrived: float, last: list[float]) -> None:
        now = time.monotonic()
        if isinstance(event, TurnDelta) and event.token_ids:
            if not last:
                self.metrics.ttft.observe(now - arrived)
            else:
                self.metrics.itl.observe(now - last[0])
            last[:] = [now]
            self.metrics.output_tokens.inc(len(event.token_ids))
        elif isinstance(event, TurnDone):
            self.metrics.prompt_tokens.inc(event.prompt_tokens)

    def _done(self, run: TurnRun, done: TurnDone) -> None:
        if done.recovery is Recovery.REPLAY:  # answered from the ledger: counted when it ran
            return
        head = run.job.head
        messages = run.job.messages
        self.metrics.turn_done(continued=head is not None, cached_tokens=done.cached_tokens,
                               recovery=done.recovery, moved=head is not None and head.owner != done.replica,
                               reused_from=done.reused_from, tool_resume=bool(messages) and messages[-1]["role"] == "tool",
                               tool_calls=len(done.tool_calls))

    async def _events(self, run: TurnRun, first: TurnEvent, events: AsyncIterator[TurnEvent],
                      arrived: float) -> AsyncIterator[TurnEvent]:
        """The turn's events from `first` on, observed for the metrics: TurnDelta*, then its
        TurnDone or TurnFailed (the last one)."""
        event, last = first, []
        while True:
            self._observe(event, arrived, last)
            if isinstance(event, TurnDone):
                self._done(run, event)
            yield event
            if isinstance(event, (TurnDone, TurnFailed)):
                return
            event = await anext(events)

    def _format(self, body: ChatCompletionRequest, run: TurnRun) -> ChatFormat:
        conv = run.job.conversation
        return ChatFormat(run.job.request_id, self.model, conv.id if conv else None, bool(body.logprobs))

    async def _collect(self, run: TurnRun, first: TurnEvent, events: AsyncIterator[TurnEvent],
                       arrived: float) -> tuple[str, list, TurnDone]:
        """The whole turn: its text, logprobs and TurnDone (the tool calls come whole with it)."""
        text, logprobs, status = [], [], 500
        try:
            async for event in self._events(run, first, events, arrived):
                if isinstance(event, TurnFailed):
                    error = first_error(event)
                    status = error.status
                    raise error
                if isinstance(event, TurnDelta):
                    text.append(event.text)
                    logprobs.extend(event.logprobs or ())
            status = 200
        finally:  # counted out first: a second cancellation may interrupt the await below
            self._finished(status)
            await run.close()
        return "".join(text), logprobs, event

    async def _complete(self, body: ChatCompletionRequest, run: TurnRun, first: TurnEvent,
                        events: AsyncIterator[TurnEvent], arrived: float) -> Response:
        text, logprobs, done = await self._collect(run, first, events, arrived)
        return JSONResponse(self._format(body, run).completion(text, logprobs, done))

    async def _relay(self, run: TurnRun, first: TurnEvent, events: AsyncIterator[TurnEvent], arrived: float,
                     stream: "EventStream") -> AsyncIterator[str]:
        """The turn's events as `stream` renders them (SSE)."""
        status = 499  # the client went away before the end
        try:
            for chunk in stream.start():
                yield chunk
            async for event in self._events(run, first, events, arrived):
                if isinstance(event, TurnFailed):
                    error = first_error(event)
                    status = error.status
                    for chunk in stream.error(error):
                        yield chunk
                    return
                if isinstance(event, TurnDelta):
                    for chunk in stream.delta(event):
                        yield chunk
            for chunk in stream.end(event):
                yield chunk
            status = 200
        finally:  # counted out first: a second cancellation may interrupt the await below
            self._finished(status)
            await run.close()

    # -- responses --------------------------------------------------------------------------
    @api.post("/v1/responses")
    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        arrived = time.monotonic()
        self._check_model(body.model)
        cache = await self._cache()
        plan = await responses_plan.plan(cache, self._scope(request, body.cache_salt), body)
        def start(plan: responses_plan.Plan) -> Callable[[], dict[str, Any]]:
            return lambda: dict(messages=plan.messages, conversation=plan.conversation, request_id=plan.publish_id,
                                sampling=body.sampling(DEFAULT_MAX_TOKENS), scope=self._scope(request, body.cache_salt),
                                wait_if_busy=True, tools=body.engine_tools(), parse_tool_calls=body.calls_tools)

        try:
            run, first, events = await self._start_turn(start(plan), expect_turn=plan.expect_turn)
        except HeadMoved:
            if plan.fork_source() is None:  # a new conversation's id taken meanwhile, or a rewound one
                raise errors.busy(plan.conversation.id) from None
            plan = await responses_plan.fork(cache, plan)
            run, first, events = await self._start_turn(start(plan), expect_turn=plan.expect_turn)
        form = responses_plan.response_body(body, plan, self.model, run.job.head.turn if run.job.head else 0)
        if body.stream:
            return _ClosingStream(self._relay(run, first, events, arrived, ResponseStream(form)),
                                  media_type="text/event-stream")
        text, _, done = await self._collect(run, first, events, arrived)
        return JSONResponse(form.done(text, done))

    @api.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str, request: Request,
                           cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        return await responses_plan.retrieve(await self._cache(), self._scope(request, cache_salt), response_id,
                                        self.model)

    @api.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(self, response_id: str, request: Request,
                              cache_salt: Annotated[CacheSalt, Query()] = "",
                              order: Literal["asc", "desc"] = "desc") -> dict:
        return await responses_plan.input_items(await self._cache(), self._scope(request, cache_salt), response_id,
                                           order)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request,
                              cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        scope = self._scope(request, cache_salt)
        deleted = await responses_plan.delete(await self._cache(), scope, response_id,
                                         int(self.settings.lease_ttl_s * 1000))
        conv = ConversationRef(responses_plan.ResponseId.parse(response_id).conversation_id, scope)
        await self._forget_locally(conv, deleted)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @api.post("/v1/conversations")
    async def create_conversation(self, body: ConversationCreate) -> dict:
        """A fresh id: the conversation is stored with its first response (POST /v1/responses
        with `conversation`)."""
        return {"id": responses_plan.new_conversation_id(), "object": "conversation", "created_at": int(time.time()),
                "metadata": body.metadata or {}}

    # -- models, conversations, health, metrics ------------------------------------------------
    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                            "owned_by": "hybridserve"}]}

    async def _ledger(self, request: Request, conversation_id: str, cache_salt: str):
        """The caller's conversation's ledger (404 if there is none, 503 if the service is down)."""
        _check_id(conversation_id)
        try:
            return await (await self._cache()).read_ledger(self._conversation(request, conversation_id, cache_salt))
        except NotFound:
            raise _unknown(conversation_id) from None
        except CacheError as e:
            raise errors.overloaded(f"cache service unavailable: {e}") from e

    @api.get("/v1/conversations/{conversation_id}")
    async def get_conversation(self, conversation_id: str, request: Request,
                               cache_salt: Annotated[CacheSalt, Query()]) -> dict:
        ledger = await self._ledger(request, conversation_id, cache_salt)
        head = ledger.head
        return {
            "id": conversation_id, "object": "conversation", "turn": head.turn,
            "created_at": ledger.turns[0].committed_at_ms // 1000 if ledger.turns else 0, "metadata": {},
            "head": {"version": head.version, "turn": head.turn, "committed_tokens": head.committed_tokens,
                     "tokens_sha256": head.tokens_sha256, "owner": head.owner_replica,
                     "tier_version": head.tier_version},
            "turns": [{"turn": i, "messages": [{"role": m.role, "content": m.content} for m in t.messages],
                       "token_ids": list(t.token_ids)} for i, t in enumerate(ledger.turns, start=1)],
        }

    @api.get("/v1/conversations/{conversation_id}/items")
    async def conversation_items(self, conversation_id: str, request: Request,
                                 cache_salt: Annotated[CacheSalt, Query()],
                                 order: Literal["asc", "desc"] = "desc") -> dict:
        """The ledger's messages (each turn's new messages, then its reply) as message items."""
        ledger = await self._ledger(request, conversation_id, cache_salt)
        if not ledger.head.version:
            raise _unknown(conversation_id)
        key = self._conversation(request, conversation_id, cache_salt).key
        return responses_plan.item_list([m for t in ledger.turns for m in t.messages], key, order)

    @api.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(self, conversation_id: str, request: Request,
                                  cache_salt: Annotated[CacheSalt, Query()]) -> dict:
        _check_id(conversation_id)
        conv = self._conversation(request, conversation_id, cache_salt)
        cache = await self._cache()
        try:
            lease = await cache.acquire_lease(conv, int(self.settings.lease_ttl_s * 1000))
            if lease.head.version == 0:
                await cache.release_lease(conv, lease)
                raise _unknown(conversation_id)
            # Deleting drops the lease too; a turn started after this point begins a new conversation.
            await cache.delete_conversation(conv)
        except LeaseHeld:
            raise errors.busy(conversation_id) from None
        except CacheError as e:
            raise errors.overloaded(f"cache service unavailable: {e}") from e
        await self._forget_locally(conv, HeadRef.of(lease.head))
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def _forget_locally(self, conv: ConversationRef, deleted: HeadRef) -> None:
        """The owner's local copy frees its blocks now. Best effort and bounded: the conversation
        is gone from the service already, and a stale copy is never used (workers check it
        against the head). With every replica at max_ongoing_requests the call would back off
        for as long as they stay full; DELETE does not wait for that. A copy left behind (here,
        or on a replica that served an earlier turn) expires within replica_copy_ttl_s."""
        if not deleted.owner:
            return
        response = self.workers.forget.remote(ReplicaCall(deleted.owner), conv, deleted)
        try:
            await asyncio.wait_for(response, self.settings.forget_timeout_s)
        except TimeoutError:
            response.cancel()
            log.warning("the owner of %s did not answer within %.1f s: its local copy stays until it expires",
                        conv.id, self.settings.forget_timeout_s)
        except (RayError, BackPressureError) as e:
            log.warning("the owner of %s kept its local copy until it expires: %s", conv.id, e)

    @api.get("/health")
    async def health(self) -> Response:
        try:
            await (await self._cache()).wait_ready(timeout_s=2.0)
        except (TimeoutError, CacheError) as e:
            return JSONResponse({"status": "unavailable", "reason": f"cache service: {e!r}"}, status_code=503,
                                headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics(self) -> Response:
        try:  # the index size is the service's; a scrape never waits long for it
            stats = await asyncio.wait_for((await self._cache()).stats(), STATS_SCRAPE_S)
            self.metrics.prefix_index_names.set(stats.prefix_index_names)
        except Exception:  # noqa: BLE001 (a scrape reports the other metrics whatever the service does)
            pass
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")
