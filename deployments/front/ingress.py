"""The OpenAI-compatible HTTP front (FastAPI through `@serve.ingress`).

    POST   /v1/chat/completions        stateless, or a conversation turn (see turn/run.py)
    POST   /v1/completions             legacy completions: a raw prompt, stateless (see completions.py)
    POST   /v1/responses               OpenAI's Responses API on conversations (see responses_plan.py)
    GET    /v1/responses/{id}[/input_items], DELETE /v1/responses/{id}
    POST   /v1/conversations           a fresh conversation id (stored with its first response)
    GET    /v1/models, /v1/models/{id}   every name of served_model_name, then the checkpoint's own
    POST   /v1/responses/{id}/cancel   400: only background responses (which this server refuses) cancel
    GET    /v1/conversations/{id}      ledger and head (cache_salt query parameter, default "": the
                                       API key's scope, or the default scope, alone)
    POST   /v1/conversations/{id}/items  messages appended without a turn (conversation_items.py)
    DELETE /v1/conversations/{id}      drops the head, the ledger, the tier copy and the owner's local copy
    POST   /tokenize, /detokenize      vLLM's: a prompt or messages to ids (as they would run), ids to text
    GET    /health, /metrics, /version
    GET    /                           the playground page (playground_page.py), its files under /playground/

With API keys configured every /v1 route wants `Authorization: Bearer KEY`, and the key's
scope is prefixed to the cache salt: another key never sees a conversation's state.
"""

import asyncio
import time
import uuid
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from cache_service.client import CacheClient, CacheError
from deployments import errors
from deployments.errors import APIError
from deployments.front import conversation_items, conversations, guard, playground_page, responses_plan, vllm_fields
from deployments.front.chat_format import ChatFormat
from deployments.front.chat_models import CacheSalt, ChatCompletionRequest
from deployments.front.completions import CompletionFormat, CompletionRequest, CompletionStream
from deployments.front.inflight import InFlight, StartedTurn
from deployments.front.metrics import ServeMetrics
from deployments.front.rate_limit import RateLimiter
from deployments.front.responses_format import ResponseStream
from deployments.front.responses_models import ConversationCreate, ItemsCreate, ResponsesRequest
from deployments.front.streams import ChatStream, sse_response
from deployments.front.tokenize_models import DetokenizeRequest, TokenizeRequest
from deployments.routing import fleet
from deployments.service.connection import CacheConnection
from deployments.settings import AppSettings
from deployments.turn.outcome import IdempotencyKey
from deployments.turn.request import TurnRequest
from proto.contract import ConversationRef

STATS_SCRAPE_S = 0.5  # the longest a /metrics scrape waits for the cache service's index size
MODEL_LEN_WAIT_S = 30.0  # the longest a model list waits for a worker (one starting loads its model)
api = FastAPI(title="hybridserve", version="0.1.0",
              description="OpenAI-compatible chat completions with conversation state kept between turns")
errors.install(api)
guard.install(api)
playground_page.install(api)


def _idempotency(request: Request, body: ChatCompletionRequest | ResponsesRequest) -> IdempotencyKey | None:
    """The request's Idempotency-Key, bound to its body (the parts that change the turn); only
    where a turn is stored (a conversation's chat completion, a stored response)."""
    key = request.headers.get("idempotency-key")
    stored = body.store if isinstance(body, ResponsesRequest) else body.conversation_id is not None
    if key is None or not stored:
        return None
    if not 0 < len(key.encode()) <= 256:
        raise APIError(400, "Idempotency-Key must be 1..256 bytes", "invalid_request", param="Idempotency-Key")
    return IdempotencyKey.of(key, body.model_dump(exclude={"stream", "stream_options", "wait_if_busy"}))


@serve.deployment(name="ChatIngress", num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1})
@serve.ingress(api)
class ChatIngress:
    def __init__(self, settings: AppSettings, workers: DeploymentHandle, cache_host: DeploymentHandle | None):
        self.settings = settings
        self.workers = workers
        self.cache_host = cache_host
        self.model_names = settings.model_names
        self.model = self.model_names[0]  # canonical: what replies carry
        self._max_model_len: int | None = None  # the workers', asked once
        self.metrics = ServeMetrics(self.model)
        self.inflight = InFlight(settings, workers, self.metrics, self._cache)
        self.forgetting = conversations.Forgetting(settings, workers)
        self._connection = CacheConnection(settings, cache_host, "ingress", self.inflight.connected)
        api.state.max_body_bytes = settings.max_body_bytes
        api.state.api_keys = settings.read_api_keys()
        api.state.rate_limiter = RateLimiter(settings.rate_limit_rpm) if settings.rate_limit_rpm else None
        api.state.cors_allow_origins = settings.cors_allow_origins
        vllm_fields.Leniency.unknown_fields = settings.unknown_fields

    async def _cache(self) -> CacheClient:
        return await self._connection.get()

    def _scope(self, request: Request, cache_salt: str) -> str:
        """The caller's cache scope: its salt, scoped to its API key when authentication is on
        (checked by guard.Guard)."""
        if self.settings.auth_enabled:
            return f"{AppSettings.key_scope(guard.bearer(request))}:{cache_salt}"
        return cache_salt

    def _conversation(self, request: Request, conversation_id: str, cache_salt: str) -> ConversationRef:
        """The caller's conversation, named in its cache scope."""
        return ConversationRef(conversation_id, self._scope(request, cache_salt))

    def _check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise APIError(404, f"model {model!r} does not exist; this server has {', '.join(self.model_names)}",
                           "model_not_found", param="model")

    # -- chat ------------------------------------------------------------------------------
    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrived = time.monotonic()
        conv = None if body.conversation_id is None else self._conversation(request, body.conversation_id,
                                                                            body.cache_salt)
        self._check_model(body.model)
        turn = await self.inflight.start(lambda: TurnRequest(
            [m.as_engine_message() for m in body.messages], body.sampling(self.settings.max_output_tokens),
            self._scope(request, body.cache_salt), conv, wait_if_busy=body.wait_if_busy,
            idempotency=_idempotency(request, body), tools=body.engine_tools(),
            parse_tool_calls=body.calls_tools, template=body.template_options()), arrived)
        assert isinstance(turn, StartedTurn)  # no expect_turn: a chat turn follows whatever the head is
        job = turn.run.job
        reply_id = f"chatcmpl-{body.request_id}" if body.request_id else job.request_id
        form = ChatFormat(reply_id, self.model, conv.id if conv else None, bool(body.logprobs), job.publish_name,
                          body.n, body.prompt_logprobs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(turn.relay(ChatStream(form, include_usage)))
        texts, logprobs, prompt, done = await turn.collect()
        return JSONResponse(form.completion(texts, logprobs, done, prompt))

    # -- legacy completions -------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrived = time.monotonic()
        self._check_model(body.model)
        echo = await self._echo_text(body)  # before the turn: a refusal leaves nothing running
        turn = await self.inflight.start(lambda: TurnRequest(
            [], body.sampling(self.settings.max_output_tokens), self._scope(request, body.cache_salt),
            request_id=f"cmpl-{uuid.uuid4().hex}", prompt=body.engine_prompt()), arrived)
        assert isinstance(turn, StartedTurn)
        reply_id = f"cmpl-{body.request_id}" if body.request_id else turn.run.job.request_id
        form = CompletionFormat.of(body, reply_id, self.model, echo)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(turn.relay(CompletionStream(form, include_usage)))
        texts, logprobs, prompt, done = await turn.collect()
        return JSONResponse(form.completion(texts, logprobs, prompt, done))

    async def _echo_text(self, body: CompletionRequest) -> str:
        """The prompt the answer echoes: its text, or the text of its token ids."""
        if not body.echo or isinstance(body.prompt, str):
            return body.prompt if body.echo else ""
        text, error = await self.workers.detokenize.remote(list(body.prompt))
        if error:
            raise APIError(400, error, "invalid_request", param="prompt")
        return text

    # -- responses --------------------------------------------------------------------------
    @api.post("/v1/responses")
    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        arrived = time.monotonic()
        self._check_model(body.model)
        cache = await self._cache()
        scope = self._scope(request, body.cache_salt)
        plan = await responses_plan.plan(cache, scope, body, _idempotency(request, body))
        plan, turn = await responses_plan.start_turn(cache, plan, lambda plan: self.inflight.start(
            lambda: plan.turn_request(body, scope, self.settings.max_output_tokens), arrived))
        form = responses_plan.response_body(body, plan, self.model, turn.head_turn)
        if body.stream:
            return sse_response(turn.relay(ResponseStream(form)))
        texts, _, _, done = await turn.collect()
        return JSONResponse(form.done(texts[0], done))

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

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str, request: Request,
                              cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        raise await responses_plan.cancel_refusal(await self._cache(), self._scope(request, cache_salt), response_id)

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str, request: Request,
                              cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        scope = self._scope(request, cache_salt)
        deleted = await responses_plan.delete(await self._cache(), scope, response_id,
                                              int(self.settings.lease_ttl_s * 1000))
        conv = ConversationRef(responses_plan.ResponseId.parse(response_id).conversation_id, scope)
        await self.forgetting.locally(conv, deleted)
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
        max_model_len = await self._model_len()
        return {"object": "list", "data": [self._model_card(name, max_model_len) for name in self.model_names]}

    @api.get("/v1/models/{model_id:path}")  # a Hugging Face id has a slash
    async def model(self, model_id: str) -> dict:
        self._check_model(model_id)
        return self._model_card(model_id, await self._model_len())

    def _model_card(self, name: str, max_model_len: int | None) -> dict:
        # vLLM's fields besides OpenAI's: max_model_len, root (the checkpoint), parent.
        return {"id": name, "object": "model", "created": 0, "owned_by": "hybridserve",
                "root": self.model_names[-1], "parent": None, "max_model_len": max_model_len}

    async def _model_len(self) -> int | None:
        """The context length the workers serve (prompt + reply), from one of them (every replica
        of the app runs the same model and settings); None while none answers."""
        if self._max_model_len is None:
            try:
                self._max_model_len = await asyncio.wait_for(self.workers.max_model_len.remote(), MODEL_LEN_WAIT_S)
            except Exception:  # noqa: BLE001 (a model list is answered without it; the next asks again)
                return None
        return self._max_model_len

    @api.get("/v1/conversations/{conversation_id}")
    async def get_conversation(self, conversation_id: str, request: Request,
                               cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        conversations.check_id(conversation_id)
        conv = self._conversation(request, conversation_id, cache_salt)
        return await conversations.describe(await self._cache(), conv)

    @api.get("/v1/conversations/{conversation_id}/items")
    async def conversation_items(self, conversation_id: str, request: Request,
                                 cache_salt: Annotated[CacheSalt, Query()] = "",
                                 order: Literal["asc", "desc"] = "desc") -> dict:
        conversations.check_id(conversation_id)
        conv = self._conversation(request, conversation_id, cache_salt)
        return await conversations.items(await self._cache(), conv, order)

    @api.post("/v1/conversations/{conversation_id}/items")
    async def add_conversation_items(self, conversation_id: str, body: ItemsCreate, request: Request,
                                     cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        conversations.check_id(conversation_id)
        conv = self._conversation(request, conversation_id, cache_salt)
        return await conversation_items.append(await self._cache(), self.workers, conv, body,
                                               int(self.settings.lease_ttl_s * 1000))

    @api.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(self, conversation_id: str, request: Request,
                                  cache_salt: Annotated[CacheSalt, Query()] = "") -> dict:
        conversations.check_id(conversation_id)
        conv = self._conversation(request, conversation_id, cache_salt)
        await self.forgetting.delete(await self._cache(), conv)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @api.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict:
        if body.model is not None:
            self._check_model(body.model)
        messages = [m.as_engine_message() for m in body.messages] if body.messages else None
        ids, error = await self.workers.tokenize.remote(body.prompt, messages, body.template_options())
        if error:
            raise APIError(400, error, "invalid_request", param="messages")
        return {"count": len(ids), "max_model_len": await self._model_len(), "tokens": ids, "token_strs": None}

    @api.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self._check_model(body.model)
        text, error = await self.workers.detokenize.remote(body.tokens)
        if error:
            raise APIError(400, error, "invalid_request", param="tokens")
        return {"prompt": text}

    @api.get("/version")
    async def version(self) -> dict:
        return {"version": api.version}  # vLLM's shape

    @api.get("/", include_in_schema=False)
    async def playground(self, request: Request) -> HTMLResponse:
        return HTMLResponse(playground_page.index(request.scope.get("root_path", "")))

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
        self.metrics.vllm.kv_cache_usage.set(fleet.kv_cache_usage())
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")
