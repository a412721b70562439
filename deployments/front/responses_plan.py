"""The Responses API on conversations: what a response id names, and what a request runs.

A stored response is a committed turn of one of the caller's conversations (ids: see
responses_format.py). A request becomes one TurnRun, as a chat completion does:

    store, no previous_response_id / conversation   a new conversation conv_<hex>: its first turn is
                                                    [instructions as a system message] + input
    previous_response_id = the conversation's latest turn     the next turn of that conversation
    previous_response_id = an older turn            fork: the turns up to it are copied into a new
                                                    conversation (ForkConversation), whose next turn
                                                    this is; the original conversation is untouched
    conversation = id                               the next turn of that conversation (an id with no
                                                    turn yet starts it)
    store = false                                   a stateless request: the history (the previous
                                                    response's turns, if any) + input; nothing committed

`instructions` are the first message of a conversation's first turn. A later turn cannot change
them (the committed history is what the model saw): it sends the same instructions or none,
otherwise 400. Whichever the caller scope (cache_salt, API key), a response of another scope is
not found (404).

The head is checked under the turn's lease (TurnRequest.expect_turn and expect_publish_id): a
continuation whose response stopped being the latest meanwhile (a concurrent continuation of the
same response committed first) forks instead, a planned step of start_turn; one whose response
was deleted meanwhile (another turn may have taken its number) is a 404, on the fork too:

    plan -> start (HeadMoved?) -> fork -> start again on the fork

A fork is made for its turn alone: if that turn does not commit (refused, failed, cut short),
the fork is deleted (turn/run.drop_unpublished), so no copy is left that nobody can name.

With an Idempotency-Key (store=true), the turn is named by the key and the body (as an
idempotent chat completion's), and a new conversation's or a fork's id is derived from the key:
a retry finds the same conversation, whose turn is then answered from the ledger, not run again.
A fork is found by that id even once its source is gone (deleted, or expired by retention).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from cache_service.client import AlreadyExists, CacheClient, CacheError, InvalidArgument, LeaseHeld, NotFound, pb
from deployments import errors
from deployments.turn import outcome
from deployments.errors import APIError
from deployments.messages import HeadRef, ToolCall, TurnDelta
from deployments.front.responses_format import PUBLISH_PREFIXES, ResponseBody, ResponseId, not_found
from deployments.front.responses_models import ResponsesRequest, engine_messages
from deployments.turn.outcome import IdempotencyKey
from deployments.turn.request import HeadMoved, TurnRequest
from deployments.turn.run import drop_unpublished
from proto.contract import ConversationRef

Started = TypeVar("Started")
log = logging.getLogger("hybridserve.ingress")

# What a response read back from the ledger repeats of its request (the request is not stored).
STORED_ECHO = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
               "temperature": None, "top_p": None, "store": True, "tool_choice": "auto", "tools": [],
               "text": {"format": {"type": "text"}, "verbosity": "medium"}, "truncation": "disabled",
               "user": None, "reasoning": None, "background": False, "service_tier": "default"}


@dataclass
class Plan:
    """What one request runs: its messages (a conversation's new suffix, or a stateless
    request's whole history), where it commits, and the head turn it must find there."""

    messages: list[dict[str, Any]]
    conversation: ConversationRef | None
    expect_turn: int | None  # None: whatever the head is (appending to a named conversation)
    previous: ResponseId | None = None
    publish_id: str = ""  # what names the turn in the ledger (and in its response id)
    request_id: str = ""  # the worker's name for this run
    idempotency: IdempotencyKey | None = None
    fork_version: int = 0  # a fork made for this turn: its head version (dropped unless the turn commits)

    def fork_source(self) -> tuple[ConversationRef, int] | None:
        if self.previous is None or self.conversation is None:
            return None
        return ConversationRef(self.previous.conversation_id, self.conversation.salt), self.previous.turn

    def turn_request(self, body: ResponsesRequest, scope: str, default_max_tokens: int) -> TurnRequest:
        planned_on = self.previous.publish_id if self.previous is not None and self.conversation else ""
        return TurnRequest(self.messages, body.sampling(default_max_tokens), scope, self.conversation,
                           wait_if_busy=True, idempotency=self.idempotency, tools=body.engine_tools(),
                           parse_tool_calls=body.calls_tools, request_id=self.request_id,
                           expect_turn=self.expect_turn, expect_publish_id=planned_on,
                           drop_if_uncommitted=self.fork_version > 0)


def new_conversation_id() -> str:
    return f"conv_{uuid.uuid4().hex}"


def _conversation_id(idempotency: IdempotencyKey | None, *seed: object) -> str:
    """A new conversation's id; an idempotent request's is the same on every retry."""
    if idempotency is None:
        return new_conversation_id()
    text = "\0".join([idempotency.key_digest, *map(str, seed)])
    return f"conv_{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _unavailable(e: CacheError) -> APIError:
    return errors.cache_failed(e)


async def _turns(cache: CacheClient, conv: ConversationRef, first: int, count: int) -> pb.ReadLedgerResponse | None:
    try:
        ledger = await cache.read_ledger(conv, from_turn=first, max_turns=count)
    except NotFound:
        return None
    except CacheError as e:
        raise _unavailable(e) from e
    return ledger if ledger.head.version else None


async def _stored_turn(cache: CacheClient, scope: str, response_id: str,
                       with_previous: bool = False) -> tuple[ResponseId, pb.ReadLedgerResponse, int]:
    """The ledger around a stored response (its turn last), and the index of its turn in it."""
    rid = ResponseId.parse(response_id)
    if rid is None:
        raise not_found(response_id)
    first = max(1, rid.turn - 1) if with_previous else rid.turn
    ledger = await _turns(cache, ConversationRef(rid.conversation_id, scope), first, rid.turn - first + 1)
    index = rid.turn - first
    if ledger is None or len(ledger.turns) <= index or ledger.turns[index].publish_id != rid.publish_id:
        raise not_found(response_id)
    return rid, ledger, index


def _ledger_messages(turns) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for t in turns for m in t.messages]


def _instructions(instructions: str | None) -> list[dict[str, Any]]:
    return [] if instructions is None else [{"role": "system", "content": instructions}]


async def _check_instructions(cache: CacheClient, conv: ConversationRef, instructions: str | None,
                              first_turn: pb.LedgerTurn | None = None) -> None:
    if instructions is None:
        return
    if first_turn is None:
        ledger = await _turns(cache, conv, 1, 1)
        first_turn = ledger.turns[0] if ledger is not None and ledger.turns else None
    opening = first_turn.messages[0] if first_turn is not None and first_turn.messages else None
    if opening is None or opening.role not in ("system", "developer") or opening.content != instructions:
        raise APIError(400, "instructions: a conversation keeps the instructions it started with; send the same "
                            "instructions or none", "invalid_request", param="instructions")


async def plan(cache: CacheClient, scope: str, body: ResponsesRequest,
               idempotency: IdempotencyKey | None = None) -> Plan:
    """`idempotency`: the request's Idempotency-Key (only a stored response's is kept)."""
    idempotency = idempotency if body.store else None
    request_id = ResponseId.new_publish_id()
    publish_id = idempotency.publish_id if idempotency else request_id
    named = {"publish_id": publish_id, "request_id": request_id, "idempotency": idempotency}
    suffix = engine_messages(body.input)
    if body.previous_response_id is not None:
        try:
            rid, ledger, _ = await _stored_turn(cache, scope, body.previous_response_id)
        except APIError as e:
            retried = await _retried_fork(cache, scope, body.previous_response_id, suffix, named) \
                if e.status == 404 else None
            if retried is None:
                raise
            return retried
        conv = ConversationRef(rid.conversation_id, scope)
        if not body.store:
            history = await _turns(cache, conv, 1, rid.turn)
            if history is None or len(history.turns) < rid.turn:
                raise not_found(body.previous_response_id)
            await _check_instructions(cache, conv, body.instructions, history.turns[0])
            return Plan(_ledger_messages(history.turns[:rid.turn]) + suffix, None, None, rid, **named)
        await _check_instructions(cache, conv, body.instructions)
        return Plan(suffix, conv, rid.turn, rid, **named)
    if body.conversation_id is not None:
        conv = ConversationRef(body.conversation_id, scope)
        try:
            head = await cache.get_head_or_none(conv)
        except CacheError as e:
            raise _unavailable(e) from e
        if head is None or not head.version:
            return Plan(_instructions(body.instructions) + suffix, conv, None, **named)
        await _check_instructions(cache, conv, body.instructions)
        return Plan(suffix, conv, None, **named)
    messages = _instructions(body.instructions) + suffix
    if not body.store:
        return Plan(messages, None, None, **named)
    return Plan(messages, ConversationRef(_conversation_id(idempotency), scope), 0, **named)


async def _retried_fork(cache: CacheClient, scope: str, response_id: str, suffix: list[dict[str, Any]],
                        named: dict[str, Any]) -> Plan | None:
    """An idempotent retry of a turn that ran on a fork, once the fork's source is gone (deleted,
    or expired by retention): the fork is found by its id, which the key names, and the retry is
    answered from its ledger (or, if the key's turn is not there, refused as the source is: 404)."""
    rid, idempotency = ResponseId.parse(response_id), named["idempotency"]
    if rid is None or idempotency is None:
        return None
    target = ConversationRef(_conversation_id(idempotency, rid.conversation_id, rid.turn), scope)
    try:
        head = await cache.get_head_or_none(target)
    except CacheError as e:
        raise _unavailable(e) from e
    if head is None or not head.version:
        return None
    return Plan(suffix, target, rid.turn, rid, **named)


async def fork(cache: CacheClient, plan: Plan) -> Plan:
    """The plan continued from a copy of its conversation's turns up to the previous response
    (whether that turn is still the previous response is checked under the fork's lease)."""
    source, turn = plan.fork_source()
    target = _conversation_id(plan.idempotency, source.id, turn)
    version = 0  # an idempotent retry's fork exists already: not made for this run, not dropped by it
    try:
        version = (await cache.fork_conversation(source, target, turn=turn)).version
    except AlreadyExists:
        if plan.idempotency is None:
            raise errors.busy(target) from None
    except (NotFound, InvalidArgument):  # gone, or rewound before its turn meanwhile
        raise not_found(str(plan.previous)) from None
    except CacheError as e:
        raise _unavailable(e) from e
    return Plan(plan.messages, source.fork(target), turn, plan.previous, plan.publish_id, plan.request_id,
                plan.idempotency, version)


async def start_turn(cache: CacheClient, plan: Plan,
                     start: Callable[[Plan], Awaitable[Started | HeadMoved]]) -> tuple[Plan, Started]:
    """The plan's turn, started (`start`); where the conversation's head moved meanwhile, the
    continuation forks from the previous response and starts on the fork."""
    started = await start(plan)
    if not isinstance(started, HeadMoved):
        return plan, started
    if started.replaced:  # the previous response was deleted, another turn took its number
        raise not_found(str(plan.previous))
    if plan.fork_source() is None:  # a new conversation's id taken meanwhile, or a rewound one
        raise errors.busy(plan.conversation.id)
    plan = await fork(cache, plan)
    try:
        started = await start(plan)
    except BaseException:  # refused before its turn ran (in flight limit, busy): the fork goes
        if plan.fork_version:
            await asyncio.shield(drop_unpublished(cache, plan.conversation, plan.fork_version))
        raise
    if isinstance(started, HeadMoved):  # the run dropped its fork already
        if started.replaced:  # the fork copied the turn that replaced the previous response
            raise not_found(str(plan.previous))
        raise errors.busy(plan.conversation.id)  # a fork nobody else has named yet moved: as busy as the first
    return plan, started


def response_body(body: ResponsesRequest, plan: Plan, model: str, base_turn: int) -> ResponseBody:
    """The Response object of a request whose turn follows `base_turn` of its conversation."""
    conv = plan.conversation
    rid = ResponseId(conv.id if conv else None, base_turn + 1 if conv else 0, plan.publish_id)
    previous = body.previous_response_id
    return ResponseBody(rid, model, body.echo(), previous)


async def retrieve(cache: CacheClient, scope: str, response_id: str, model: str) -> dict[str, Any]:
    rid, ledger, index = await _stored_turn(cache, scope, response_id, with_previous=True)
    turn = ledger.turns[index]
    previous = None
    if index and ledger.turns[0].publish_id.startswith(PUBLISH_PREFIXES):
        previous = str(ResponseId(rid.conversation_id, rid.turn - 1, ledger.turns[0].publish_id))
    events = outcome.replay(turn)  # the reply's text and tool calls, as they were first sent
    text = "".join(e.text for e in events if isinstance(e, TurnDelta))
    form = ResponseBody(rid, model, STORED_ECHO, previous, created_at=turn.committed_at_ms // 1000)
    return form.done(text, events[-1])


async def cancel_refusal(cache: CacheClient, scope: str, response_id: str) -> APIError:
    """POST /v1/responses/{id}/cancel: as OpenAI's, only a background response can be cancelled,
    and this server runs none (`background` is refused): a stored response gets a 400, another
    a 404 (raised)."""
    await _stored_turn(cache, scope, response_id)
    return APIError(400, "only background responses can be cancelled; this server runs none (a response in flight "
                        "stops when its client disconnects)", "invalid_request", param="response_id")


async def input_items(cache: CacheClient, scope: str, response_id: str, order: str) -> dict[str, Any]:
    rid, ledger, index = await _stored_turn(cache, scope, response_id)
    messages = list(ledger.turns[index].messages)[:-1]  # the reply is the turn's last message
    return item_list(messages, rid.publish_id, order)


def item_list(entries, key: str, order: str, first: int = 0) -> dict[str, Any]:
    """Conversation items: each entry a message (pb.Message) or a tool call the reply made (ToolCall).
    An item's id is its position in the conversation (`first`: that of the first entry)."""
    items = [_item(entry, f"msg_{key[-16:]}_{i}") for i, entry in enumerate(entries, start=first)]
    if order == "desc":
        items.reverse()
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": False}


def _item(entry, item_id: str) -> dict[str, Any]:
    if isinstance(entry, ToolCall):
        return {"id": item_id, "type": "function_call", "call_id": entry.id, "name": entry.name,
                "arguments": entry.arguments, "status": "completed"}
    kind = "output_text" if entry.role == "assistant" else "input_text"
    return {"id": item_id, "type": "message", "role": entry.role, "status": "completed",
            "content": [{"type": kind, "text": entry.content}]}


async def delete(cache: CacheClient, scope: str, response_id: str, lease_ttl_ms: int) -> HeadRef | None:
    """Delete a conversation's latest response: its turn is rewound away (the conversation's
    first turn: the conversation is deleted, and its head returned for its owner to forget).
    An older response is a 409: the turns after it were built on it."""
    rid, _, _ = await _stored_turn(cache, scope, response_id)
    conv = ConversationRef(rid.conversation_id, scope)
    try:
        lease = await cache.acquire_lease(conv, lease_ttl_ms)
    except LeaseHeld:
        raise errors.busy(conv.id) from None
    except CacheError as e:
        raise _unavailable(e) from e
    head, done = lease.head, False
    try:
        await _stored_turn(cache, scope, response_id)  # under the lease: still there? (404 if not)
        if head.turn != rid.turn:
            raise APIError(409, "only a conversation's latest response can be deleted: later responses build on "
                                "this one", "response_not_latest")
        if rid.turn == 1:
            await cache.delete_conversation(conv)  # drops the lease too
            done = True
        else:
            await cache.rewind_conversation(conv, lease_token=lease, expected_version=head.version,
                                            turn=rid.turn - 1)
        return HeadRef.of(head)
    except CacheError as e:
        raise _unavailable(e) from e
    finally:
        if not done:
            try:
                await cache.release_lease(conv, lease)
            except CacheError as e:  # the lease expires by itself
                log.warning("could not release the lease of %s: %s", conv.id, e)
