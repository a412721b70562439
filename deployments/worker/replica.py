"""A worker replica: one engine, a turn and its two-phase commit.

    run_turn(job)
      state:    the recovery ladder (recovery_ladder.py): NEW, LOCAL, TIER_IMPORT, TIER_PREFIX
                or LEDGER_RECOMPUTE
      stream:   TurnDelta ... (leaving early = client gone = abort = discard)
      commit:   prepared -> PublishTurn (CAS on head.version, fenced by the ingress's lease)
                ok -> commit locally, TurnDone;  conflict / lease lost -> abandon, TurnFailed
      export:   the new head to the state tier (tier_export.py): before answering (sync), never
                (off), or write-behind (async)
      announce: a stateless request's or a first turn's checkpointed prefixes to the prefix index
                (routing/prefix_hints.py), in a task of its own; their names also go back in
                TurnDone.prefixes, for the ingress's own routing of the next step (no race)
      prefixes: a stateless request's long checkpoints go to the state tier, and a prefix the tier
                holds is imported before the request when cheaper than computing it (prefix_tier.py)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from cache_service.client import (
    CacheClient,
    CacheError,
    InvalidArgument,
    LeaseLost,
    SentReply,
    SentToolCall,
    StorageFull,
    TurnResult,
    VersionConflict,
)
from deployments.service.connection import CacheConnection
from deployments.worker.engine_session import EngineSession
from deployments.worker.session import Session
from deployments.routing.prefix_hints import Announcer, keyed
from deployments.messages import (
    ErrorKind,
    HeadRef,
    Recovery,
    ReplicaCall,
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnJob,
    prompt_as_messages,
)
from deployments.worker.choices import OtherChoice
from deployments.worker.logprob_texts import prompt_logprobs, reply_logprobs
from deployments.worker.recovery_ladder import attach
from deployments.routing.router import StickyConversationRouter
from deployments.settings import AppSettings, Backend
from deployments.worker.text_calls import TextCalls
from deployments.worker.prefix_tier import PrefixTier
from deployments.worker.tier_export import TierExporter
from deployments.tool_replies import ReplyCalls
from deployments.worker.vllm_session import VllmSession
from proto.contract import ConversationRef, tools_scope
from workers.conversation.records import TurnCommit
from workers.errors import (
    ConversationBusyError,
    EngineShutdownError,
    InvalidRequestError,
    PromptTooLongError,
    TurnResolvedError,
)
from workers.load import Rate
from workers.request import FinishReason
from workers.sampling import SamplingParams

log = logging.getLogger("hybridserve.worker")


def model_dir_of(settings: AppSettings) -> str:
    """The checkpoint the workers load: `model`, or when empty the backend's built-in one (our
    engine: the trained model shipped in the package)."""
    from workers.checkpoint.builtin import VLLM_BUILTIN_ARCH, builtin_model_dir, default_model_dir

    if settings.model:
        return settings.model
    if settings.backend is Backend.VLLM:
        return str(builtin_model_dir(arch=VLLM_BUILTIN_ARCH))
    return str(default_model_dir())


def open_session(settings: AppSettings) -> Session:
    """The engine session of the app's backend, on its model (empty: the built-in one)."""
    if settings.backend is Backend.VLLM:
        return VllmSession(model_dir_of(settings), settings)
    return EngineSession(model_dir_of(settings), settings)

# A publish unanswered this long is answered "outcome unknown" (the ingress then asks the
# ledger); the replica keeps resending it for up to PUBLISH_RESOLVE_S to settle its own copy.
PUBLISH_ANSWER_S = 45.0
PUBLISH_RESOLVE_S = 120.0


@serve.deployment(
    name="Worker",
    num_replicas=2,  # a conversation survives losing one; config.yaml switches on autoscaling
    max_ongoing_requests=8,
    ray_actor_options={"num_cpus": 0.5},
    graceful_shutdown_timeout_s=30,
    request_router_config=RequestRouterConfig(
        request_router_class=StickyConversationRouter,
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    ),
)
class Worker(TextCalls):
    def __init__(self, settings: AppSettings, cache_host: DeploymentHandle | None):
        self.settings = settings
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.session = open_session(settings)
        self._connection = CacheConnection(settings, cache_host, f"worker:{self.replica_id}")
        self._tasks: set[asyncio.Task] = set()
        self._expiring = False  # the sweep of idle copies, started with the first turn
        self.exporter = TierExporter(self.session, settings, self._cache, self._spawn)
        self.announcer = Announcer(self.replica_id, self._cache, self._spawn)
        # Head tokens/s of its tier imports (ledger read, state fetch, install): what the router
        # prices moving a conversation here at.
        self.import_rate = Rate()
        self.prefix_tier = PrefixTier(self.session, settings, self._cache, self._spawn, self.import_rate)

    # -- cache service ------------------------------------------------------------------------
    async def _cache(self) -> CacheClient:
        return await self._connection.get()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check_health(self) -> None:
        """Serve replaces a replica whose engine died (the vLLM backend's engine host process)."""
        self.session.check_health()

    async def record_routing_stats(self) -> dict[str, Any]:
        await self._cache()  # Serve calls this every period from the start: connect before the first turn
        load = await self.session.load()
        # reported_at (wall time, as the router's): what was sent after it is in no report (routing/sent_log.py)
        return {"reported_at": load.taken_at or time.time(), "running_requests": load.requests, "free_kv_blocks": load.free_kv_blocks,
                "waiting_prefill_tokens": load.waiting_prefill_tokens,
                "prefill_tokens_per_s": load.prefill_tokens_per_s, "mean_prefill_tokens": load.mean_prefill_tokens,
                "import_tokens_per_s": self.import_rate.value,
                # read by the ingress's /metrics (vllm:kv_cache_usage_perc, routing/fleet.py)
                "kv_cache_usage": await self.session.kv_cache_usage()}

    # -- state of deleted conversations ---------------------------------------------------------
    async def forget(self, call: ReplicaCall, conv: ConversationRef, deleted: HeadRef) -> str:
        """Drop a deleted conversation's local heads, ledger and pending export now rather than
        at eviction, if they are the deleted head's: a conversation re-created under the same id
        and salt may have committed its first turn here before this call arrived, and keeps its
        head and its export. Returns this replica's id (the router may have sent the call
        elsewhere: a no-op there)."""
        self.exporter.forget(conv, deleted)
        try:
            await self.session.forget(conv, deleted)
        except ConversationBusyError as e:  # a turn of the re-created conversation already runs here
            log.warning("not forgetting %s: %s", conv.id, e)
        return self.replica_id

    async def _expire_idle_copies(self) -> None:
        """Forget conversations idle here for replica_copy_ttl_s, or the conversation TTL if
        shorter (a DELETE routed to another replica, or the conversation's expiry in the cache
        service, leaves this copy until then); checked every min(60 s, ttl / 4)."""
        ttl = self.settings.local_copy_ttl_s
        while True:
            await asyncio.sleep(min(60.0, ttl / 4))
            try:
                await self.session.forget_idle(ttl)
            except EngineShutdownError:
                return
            except Exception:  # the next sweep tries again; a copy is only ever older, never wrong
                log.exception("forgetting idle conversations")

    async def prefix_tier_counters(self, call: ReplicaCall) -> tuple[str, dict[str, int]]:
        """(this replica, its prefix-tier exports and imports): for operators and tests."""
        return self.replica_id, dict(self.prefix_tier.counters)

    async def pending_exports(self, call: ReplicaCall) -> tuple[str, int]:
        """(this replica, committed heads waiting for their export to the tier): bounded by the
        conversations committed within the export delay; for operators and tests."""
        return self.replica_id, self.exporter.pending()

    async def held_heads(self, call: ReplicaCall, conv: ConversationRef | None = None) -> tuple[str, int]:
        """(this replica, committed heads it holds, of one conversation if given): what DELETE
        frees, for operators and tests."""
        return self.replica_id, await self.session.held_heads(conv)

    # -- a turn -----------------------------------------------------------------------------
    async def run_turn(self, job: TurnJob) -> AsyncIterator[TurnEvent]:
        try:
            params = SamplingParams(**job.sampling)
            await self.session.prepare_grammar(params)  # a schema that cannot compile: refused here
        except (InvalidRequestError, TypeError) as e:
            yield TurnFailed(ErrorKind.INVALID, str(e))
            return
        try:
            if job.prompt is not None:
                stream = self.session.stream_completion(job.prompt, params, job.request_id, job.scope)
                recovery = Recovery.NEW
            elif job.conversation is None:
                recovery = Recovery.NEW
                if job.tier_prefix is not None and not params.deterministic and await self.prefix_tier.import_for(
                        tools_scope(job.scope, job.tools), job.scope, job.messages, list(job.tools), job.template,
                        job.tier_prefix):
                    recovery = Recovery.PREFIX_IMPORT
                stream = self.session.stream_stateless(job.messages, params, job.request_id, job.scope,
                                                       list(job.tools), job.template)
            else:
                if not self._expiring:
                    self._expiring = True
                    self._spawn(self._expire_idle_copies())
                self.session.turn_started(job.conversation)
                started = time.perf_counter()
                recovery = await attach(self.session, self.settings, self._cache, job)
                if recovery is Recovery.TIER_IMPORT:
                    self.import_rate.observe(job.head.committed_tokens, time.perf_counter() - started)
                stream = self.session.stream_turn(job.conversation, job.messages, params, job.request_id,
                                                  list(job.tools), job.template)
            async for event in self._run(job, params, stream, recovery):
                yield event
        except InvalidRequestError as e:
            yield TurnFailed(ErrorKind.TOO_LONG if isinstance(e, PromptTooLongError) else ErrorKind.INVALID, str(e))
        except ConversationBusyError as e:
            yield TurnFailed(ErrorKind.CONFLICT, str(e))
        except StorageFull as e:
            yield TurnFailed(ErrorKind.STORAGE_FULL, f"cache service: {e}")
        except CacheError as e:
            yield TurnFailed(ErrorKind.UNAVAILABLE, f"cache service: {e}")
        except EngineShutdownError as e:  # this replica's engine is gone: Serve replaces it (check_health)
            yield TurnFailed(ErrorKind.UNAVAILABLE, f"engine: {e}")
        finally:
            if job.conversation is not None:
                self.session.turn_ended(job.conversation)
                self.exporter.turn_ended(job.conversation)

    async def _run(self, job: TurnJob, params: SamplingParams, stream, recovery: Recovery) -> AsyncIterator[TurnEvent]:
        """The turn's events. A turn prepared but never handed to `_commit` (the client left at a
        yield after its final output, or the turn failed after it) is abandoned at once: held
        until it expired, it kept its conversation busy here and every next turn got a 409. A
        stream left before its final output is its session's to clean up (both backends abandon
        a turn that finished as it was left)."""
        completion, last, handed = 0, None, False
        form = self.session.tool_format if job.parse_tool_calls else None
        # n > 1: choice 0 is the turn (committed, announced); the others end as ChoiceEnds
        others: dict[int, OtherChoice] = {}
        try:
            calls = ReplyCalls(form, job.publish_name)
            async for out in stream:
                if out.error:
                    last = out if out.index == 0 else last  # choice 0's prepared turn is abandoned below
                    yield TurnFailed(ErrorKind.INVALID if out.error_invalid else ErrorKind.INTERNAL, out.error)
                    return
                if out.index:
                    choice = others.setdefault(
                        out.index, OtherChoice(out.index, ReplyCalls(form, f"{job.publish_name}.{out.index}")))
                    for event in choice.events(out, reply_logprobs(out.new_tokens, params, self.session.token_text)):
                        yield event
                    continue
                last = out
                completion += len(out.new_tokens)
                text, call_deltas = calls.feed(out.text_delta)
                prompt = prompt_logprobs(out.prompt_logprobs, self.session.token_text)
                if out.new_tokens or text or call_deltas or prompt:
                    yield TurnDelta(text, tuple(out.new_token_ids), reply_logprobs(
                        out.new_tokens, params, self.session.token_text), call_deltas, prompt)
            ends = [c.end for c in others.values() if c.end is not None]
            if last is None or not last.finished or len(ends) != params.n - 1:
                yield TurnFailed(ErrorKind.INTERNAL, "the engine ended the stream before the request finished")
                return
            if last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                yield TurnFailed(ErrorKind.INTERNAL, f"the turn ended with {last.finish_reason}")
                return
            text, call_deltas = calls.finish()
            if text or call_deltas:
                yield TurnDelta(text, (), None, call_deltas)
            reason = last.finish_reason.value
            if calls.calls and last.finish_reason is FinishReason.STOP:
                reason = "tool_calls"
            done = TurnDone(reason, last.num_prompt_tokens, completion, last.num_cached_tokens,
                            recovery, self.replica_id, reused_from=last.reused_from.value, tool_calls=calls.calls,
                            others=tuple(sorted(ends, key=lambda e: e.index)))
            hint_scope = tools_scope(job.scope, job.tools)
            if job.conversation is None:
                named = job.messages if job.prompt is None else prompt_as_messages(job.prompt)
                reply = calls.reply_message()
                prefixes = self.announcer.after_turn(hint_scope, named, reply, last.checkpoints, last.checkpoint_keys)
                if job.prompt is None:
                    self.prefix_tier.offer(hint_scope, keyed(hint_scope, named, reply, last.checkpoints,
                                                             last.checkpoint_keys))
                yield replace(done, prefixes=prefixes)
                return
            if last.turn_commit is None:
                yield TurnFailed(ErrorKind.INTERNAL, "the engine finished the turn without preparing it")
                return
            handed = True  # from here `_commit` owns the prepared turn, whatever happens to this stream
            outcome = await self._commit(job, done, last.turn_commit, calls)
            if isinstance(outcome, TurnDone) and job.head is None:  # a first turn: its messages are the chat
                reply = calls.reply_message()
                outcome = replace(outcome, prefixes=self.announcer.after_turn(
                    hint_scope, job.messages, reply, last.checkpoints, last.checkpoint_keys))
                self.prefix_tier.offer(hint_scope, keyed(hint_scope, job.messages, reply, last.checkpoints,
                                                         last.checkpoint_keys))
            yield outcome
        finally:
            self.announcer.withdraw(self.session.withdrawn_prefixes())  # evicted since the last turn ended
            prepared = last.turn_commit if last is not None else None
            if prepared is not None and not handed:
                self._spawn(self._abandon(prepared))  # not awaited: this stream may be closing or cancelled

    async def _commit(self, job: TurnJob, done: TurnDone, prepared: TurnCommit, calls: ReplyCalls) -> TurnEvent:
        """Publish the prepared turn, then commit or abandon it here as the service decided.

        Runs to its end even when the turn is cancelled (the client left mid-publish): the
        publish may land, and this replica's copy must follow the service's verdict. A publish
        whose outcome is unknown is sent again, unchanged (the service answers a resent
        publish with the head it made, or refuses it): the first definite answer decides."""
        resolution = asyncio.ensure_future(self._publish_and_resolve(job, done, prepared, calls))
        try:
            return await asyncio.wait_for(asyncio.shield(resolution), PUBLISH_ANSWER_S)
        except TimeoutError:  # still unknown: the ingress asks the ledger; the copy waits for the verdict
            self._tasks.add(resolution)
            resolution.add_done_callback(self._tasks.discard)
            return TurnFailed(ErrorKind.OUTCOME_UNKNOWN, "the cache service did not answer the publish")

    async def _publish_and_resolve(self, job: TurnJob, done: TurnDone, prepared: TurnCommit,
                                   calls: ReplyCalls) -> TurnEvent:
        client, conv = await self._cache(), job.conversation
        # The ledger keeps both faces of the reply: the prepared turn's message (every token, for
        # the next turn's prompt) and, in `sent`, what this stream gave the client (a replay's).
        sent = SentReply(content=calls.content, tool_calls=[
            SentToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in done.tool_calls])
        result = TurnResult(finish_reason=done.finish_reason, prompt_tokens=done.prompt_tokens,
                            completion_tokens=done.completion_tokens, cached_tokens=done.cached_tokens,
                            tool_format=calls.form.name if calls.form is not None else "", sent=sent)
        deadline = asyncio.get_running_loop().time() + PUBLISH_RESOLVE_S
        while True:
            try:
                head = await client.publish_turn(
                    conv, lease_token=job.lease, expected_version=job.head.version if job.head else 0,
                    messages=prepared.messages, token_ids=prepared.token_ids,
                    committed_tokens=prepared.committed_tokens, tokens_sha256=prepared.tokens_digest,
                    owner_replica=self.replica_id, release_lease=False, publish_id=job.publish_name,
                    result=result)
                break
            except (VersionConflict, LeaseLost) as e:
                await self._abandon(prepared)
                return TurnFailed(ErrorKind.CONFLICT, f"the turn was not committed: {e}")
            except StorageFull as e:  # refused before it wrote anything: definitely not committed
                await self._abandon(prepared)
                return TurnFailed(ErrorKind.STORAGE_FULL, f"the turn was not committed: {e}")
            except InvalidArgument as e:  # the service refused what this worker computed: a bug here
                await self._abandon(prepared)
                log.error("publish of %s refused: %s", job.publish_name, e)
                return TurnFailed(ErrorKind.INTERNAL, "the turn was not committed")
            except CacheError as e:  # unavailable or past its deadline: it may have landed
                if asyncio.get_running_loop().time() > deadline:
                    # The ledger will say; this copy goes (a committed head it held is recomputed
                    # or imported where the next turn runs: the ledger is the truth, not this copy).
                    await self._abandon(prepared)
                    return TurnFailed(ErrorKind.OUTCOME_UNKNOWN, f"the publish's outcome is unknown: {e}")
                log.warning("publish of %s unanswered, sending it again: %s", job.publish_name, e)
                await asyncio.sleep(0.2)
        try:
            await self.session.commit(prepared)
        except TurnResolvedError as e:  # expired meanwhile: the service has the turn, this copy is gone
            log.warning("committed turn %s no longer prepared here: %s", job.request_id, e)
        await self.exporter.committed(conv, HeadRef.of(head))
        return TurnDone(**{**done.__dict__, "turn": head.turn, "head_version": head.version})

    async def _abandon(self, prepared: TurnCommit) -> None:
        try:
            await self.session.abandon(prepared)
        except TurnResolvedError as e:  # already expired: nothing left to free
            log.warning("abandoning %s: %s", prepared.request_id, e)

    async def __del__(self) -> None:
        """Graceful shutdown (scale-in, redeploy): hand the heads only this replica holds to the
        tier, so the next owner imports them instead of recomputing."""
        if not hasattr(self, "exporter"):  # __init__ failed: nothing was started
            return
        await self.exporter.shutdown()
        for task in list(self._tasks):
            task.cancel()
        self.session.shutdown()
        if self._connection.client is not None:
            await self._connection.client.close()
