"""A worker replica: one engine, the turn's two-phase commit, the recovery ladder, exports.

    run_turn(job)
      state:    head is None            -> a new conversation (drop any stale local copy)
                local state == head      -> LOCAL (a hit)
                tier holds head.version  -> TIER_IMPORT (the head migrates here)
                tier holds an older one  -> TIER_PREFIX (imported; the turns after it run again)
                else                     -> LEDGER_RECOMPUTE (token ids from the service's ledger)
      stream:   TurnDelta ... (leaving early = client gone = abort = discard)
      commit:   prepared -> PublishTurn (CAS on head.version, fenced by the ingress's lease)
                ok -> commit locally, TurnDone;  conflict / lease lost -> abandon, TurnFailed
      export:   the new head to the state tier: before answering (sync), never (off), or write-behind
                (async): once the conversation has been quiet here for tier_export_delay_s

    async export of one conversation (a next turn often follows within milliseconds):
      turn N ends ──delay──> export head N            quiet: the tier holds head N
      turn N ends ──> turn N+1 starts ──> timer fires: a turn runs here, skip
                                   ──> turn N+1 ends ──delay──> export head N+1
    Exporting head N while turn N+1 prefills would only compete with it for the CPU (hashing,
    serialization, the service storing chunks) and be superseded a moment later.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from cache_service.client import (
    CacheClient,
    CacheError,
    Conversation,
    DataLoss,
    InvalidArgument,
    LeaseLost,
    NotFound,
    VersionConflict,
)
from deployments.cache_access import CacheConnection
from deployments.engine_session import EngineSession
from deployments.protocol import (
    ErrorKind,
    HeadRef,
    Recovery,
    ReplicaCall,
    TokenLogprob,
    TurnDelta,
    TurnDone,
    TurnEvent,
    TurnFailed,
    TurnJob,
)
from deployments.router import StickyConversationRouter
from deployments.settings import AppSettings, TierExport
from workers.conversation.records import LedgerTurn, TurnCommit
from workers.errors import (
    ConversationBusyError,
    ConversationNotFoundError,
    CorruptStateError,
    InvalidRequestError,
    OutOfCacheError,
    PromptTooLongError,
    TurnResolvedError,
)
from workers.request import FinishReason
from workers.sampling import SamplingParams

log = logging.getLogger("hybridserve.worker")

HEARTBEAT_S = 3.0


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
class Worker:
    def __init__(self, settings: AppSettings, cache_host: DeploymentHandle | None):
        from workers.checkpoint.builtin import builtin_model_dir

        self.settings = settings
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()  # what the registry lists as its address
        self.session = EngineSession(settings.model or str(builtin_model_dir()), settings)
        self._client: CacheClient | None = None
        self._connection = CacheConnection(settings, cache_host, f"worker:{self.replica_id}", self._connected)
        self._tasks: set[asyncio.Task] = set()
        # Heads committed here whose state the tier does not hold yet: exported on shutdown.
        self._unexported: dict[tuple[str, str], HeadRef] = {}
        self._turns_here: Counter[tuple[str, str]] = Counter()  # turns running here, per conversation
        self._export_due: dict[tuple[str, str], asyncio.TimerHandle] = {}  # async exports waiting for quiet

    # -- cache service ------------------------------------------------------------------------
    async def _cache(self) -> CacheClient:
        return await self._connection.get()

    def _connected(self, client: CacheClient) -> None:
        self._client = client
        self._spawn(self._heartbeats())

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _heartbeats(self) -> None:
        client, ttl_ms, epoch = self._client, int(HEARTBEAT_S * 3000), 0
        while True:
            running, free = await self.session.load()
            try:
                if epoch == 0:
                    epoch = (await client.register_replica(self.replica_id, self.actor_name, ttl_ms)).epoch
                await client.heartbeat(self.replica_id, epoch, ttl_ms, running_requests=running, free_kv_blocks=free)
            except NotFound:
                epoch = 0  # expired (e.g. the service restarted with an empty registry): register again
            except CacheError as e:
                log.warning("heartbeat failed: %s", e)
            await asyncio.sleep(HEARTBEAT_S)

    async def record_routing_stats(self) -> dict[str, Any]:
        await self._cache()  # Serve calls this every period from the start: registration begins here
        running, free = await self.session.load()
        return {"running_requests": running, "free_kv_blocks": free}

    # -- state of deleted conversations ---------------------------------------------------------
    async def forget(self, call: ReplicaCall, conversation_id: str, cache_salt: str, deleted: HeadRef) -> str:
        """Drop a deleted conversation's local heads, ledger and pending export now rather than
        at eviction, if they are the deleted head's: a conversation re-created under the same id
        and salt may have committed its first turn here before this call arrived, and keeps its
        head and its export. Returns this replica's id (the router may have sent the call
        elsewhere: a no-op there)."""
        key = (conversation_id, cache_salt)
        pending = self._unexported.get(key)
        if pending is not None and pending.same_state(deleted):
            del self._unexported[key]
            due = self._export_due.pop(key, None)
            if due is not None:
                due.cancel()
        try:
            await self.session.forget(conversation_id, cache_salt, deleted)
        except ConversationBusyError as e:  # a turn of the re-created conversation already runs here
            log.warning("not forgetting %s: %s", conversation_id, e)
        return self.replica_id

    async def held_heads(self, call: ReplicaCall, conversation_id: str | None = None,
                         cache_salt: str = "") -> tuple[str, int]:
        """(this replica, committed heads it holds, of one conversation if given): what DELETE
        frees, for operators and tests."""
        return self.replica_id, await self.session.held_heads(conversation_id, cache_salt)

    # -- a turn -----------------------------------------------------------------------------
    async def run_turn(self, job: TurnJob) -> AsyncIterator[TurnEvent]:
        try:
            params = SamplingParams(**job.sampling)
        except (InvalidRequestError, TypeError) as e:
            yield TurnFailed(ErrorKind.INVALID, str(e))
            return
        try:
            if job.conversation_id is None:
                stream, recovery = self.session.stream_stateless(job.messages, params, job.request_id), Recovery.NEW
            else:
                self._turns_here[(job.conversation_id, job.cache_salt)] += 1
                recovery = await self._attach(job)
                stream = self.session.stream_turn(
                    job.conversation_id, job.cache_salt, job.messages, params, job.request_id)
            async for event in self._run(job, params, stream, recovery):
                yield event
        except InvalidRequestError as e:
            yield TurnFailed(ErrorKind.TOO_LONG if isinstance(e, PromptTooLongError) else ErrorKind.INVALID, str(e))
        except ConversationBusyError as e:
            yield TurnFailed(ErrorKind.CONFLICT, str(e))
        except CacheError as e:
            yield TurnFailed(ErrorKind.UNAVAILABLE, f"cache service: {e}")
        finally:
            if job.conversation_id is not None:
                self._turn_ended((job.conversation_id, job.cache_salt))

    def _turn_ended(self, key: tuple[str, str]) -> None:
        self._turns_here[key] -= 1
        if self._turns_here[key] <= 0:
            del self._turns_here[key]
        # Also after a failed turn: the head it would have replaced may still wait for its export.
        if key in self._unexported and self.settings.tier_export is TierExport.ASYNC:
            self._export_when_quiet(key)

    def _export_when_quiet(self, key: tuple[str, str]) -> None:
        due = self._export_due.pop(key, None)
        if due is not None:
            due.cancel()
        self._export_due[key] = asyncio.get_running_loop().call_later(
            self.settings.tier_export_delay_s, self._export_if_quiet, key)

    def _export_if_quiet(self, key: tuple[str, str]) -> None:
        self._export_due.pop(key, None)
        head = self._unexported.get(key)
        if head is not None and not self._turns_here[key]:  # else the running turn's end schedules again
            self._spawn(self._export_head(*key, head))

    async def _attach(self, job: TurnJob) -> Recovery:
        """Make this engine hold the conversation's committed head, by the recovery ladder."""
        conv_id, salt, head = job.conversation_id, job.cache_salt, job.head
        if head is None:
            await self.session.forget(conv_id, salt)  # a deleted and re-created conversation
            return Recovery.NEW
        if await self.session.holds(conv_id, salt, head):
            return Recovery.LOCAL
        client, conv = await self._cache(), Conversation(conv_id, salt)
        ledger = await client.read_ledger(conv)
        turns = [LedgerTurn(tuple({"role": m.role, "content": m.content} for m in t.messages), tuple(t.token_ids))
                 for t in ledger.turns]
        await self.session.adopt_ledger(conv_id, salt, head, turns)
        # The ledger's head is fresher than the lease's: a bypassed owner may have exported since.
        tier_version = ledger.head.tier_version
        if self.settings.tier_export is not TierExport.OFF and 0 < tier_version <= head.version:
            # An older copy (the owner died before exporting its last turns) still spares the
            # turns it covers: the engine continues it and runs only the turns after it.
            try:
                _, blob = await client.get_state(conv, tier_version)
                await self.session.import_state(conv_id, salt, blob)
                return Recovery.TIER_IMPORT if tier_version == head.version else Recovery.TIER_PREFIX
            except (NotFound, DataLoss, CorruptStateError, OutOfCacheError) as e:
                log.warning("tier import of %s failed, recomputing from the ledger: %s", conv_id, e)
        return Recovery.LEDGER_RECOMPUTE

    async def _run(self, job: TurnJob, params: SamplingParams, stream, recovery: Recovery) -> AsyncIterator[TurnEvent]:
        completion, last = 0, None
        async for out in stream:
            last = out
            if out.error:
                yield TurnFailed(ErrorKind.INTERNAL, out.error)
                return
            completion += len(out.new_tokens)
            if out.new_tokens or out.text_delta:
                yield TurnDelta(out.text_delta, tuple(out.new_token_ids), self._logprobs(out.new_tokens, params))
        if last is None or not last.finished:
            yield TurnFailed(ErrorKind.INTERNAL, "the engine ended the stream before the request finished")
            return
        if last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            yield TurnFailed(ErrorKind.INTERNAL, f"the turn ended with {last.finish_reason}")
            return
        done = TurnDone(last.finish_reason.value, last.num_prompt_tokens, completion, last.num_cached_tokens,
                        recovery, self.replica_id)
        if job.conversation_id is None:
            yield done
            return
        if last.turn_commit is None:
            yield TurnFailed(ErrorKind.INTERNAL, "the engine finished the turn without preparing it")
            return
        yield await self._commit(job, done, last.turn_commit)

    async def _commit(self, job: TurnJob, done: TurnDone, prepared: TurnCommit) -> TurnEvent:
        client, conv = await self._cache(), Conversation(job.conversation_id, job.cache_salt)
        try:
            head = await client.publish_turn(
                conv, lease_token=job.lease, expected_version=job.head.version if job.head else 0,
                messages=prepared.messages, token_ids=prepared.token_ids,
                committed_tokens=prepared.committed_tokens, tokens_sha256=prepared.tokens_digest,
                owner_replica=self.replica_id, release_lease=False, publish_id=job.request_id)
        except (VersionConflict, LeaseLost) as e:
            await self._abandon(prepared)
            return TurnFailed(ErrorKind.CONFLICT, f"the turn was not committed: {e}")
        except InvalidArgument as e:  # the service refused what this worker computed: a bug here, not bad input
            await self._abandon(prepared)
            return TurnFailed(ErrorKind.INTERNAL, f"the turn was not committed: {e}")
        except CacheError as e:
            await self._abandon(prepared)
            return TurnFailed(ErrorKind.UNAVAILABLE, f"the turn was not committed: {e}")
        except BaseException:  # cancelled while publishing: whether it landed is unknown, so drop the copy
            await asyncio.shield(self.session.abandon(prepared))
            raise
        try:
            await self.session.commit(prepared)
        except TurnResolvedError as e:  # expired meanwhile: the service has the turn, this copy is gone
            log.warning("committed turn %s no longer prepared here: %s", job.request_id, e)
        ref = HeadRef.of(head)
        self._unexported[(job.conversation_id, job.cache_salt)] = ref
        if self.settings.tier_export is TierExport.SYNC:
            await self._export_head(job.conversation_id, job.cache_salt, ref)
        return TurnDone(**{**done.__dict__, "turn": head.turn, "head_version": head.version})

    async def _abandon(self, prepared: TurnCommit) -> None:
        try:
            await self.session.abandon(prepared)
        except TurnResolvedError as e:  # already expired: nothing left to free
            log.warning("abandoning %s: %s", prepared.request_id, e)

    async def _export_head(self, conversation_id: str, cache_salt: str, head: HeadRef) -> None:
        conv = Conversation(conversation_id, cache_salt)
        try:
            version, parts = await self.session.export_state(conversation_id, cache_salt)
            await (await self._cache()).put_state(conv, version, parts)
        except VersionConflict:
            log.debug("export of %s v%d superseded by a newer turn", conversation_id, head.version)
        except (CacheError, ConversationBusyError, ConversationNotFoundError) as e:
            log.warning("export of %s v%d failed: %s", conversation_id, head.version, e)
            return
        if self._unexported.get((conversation_id, cache_salt)) == head:
            del self._unexported[(conversation_id, cache_salt)]

    def _logprobs(self, tokens, params: SamplingParams) -> tuple[TokenLogprob, ...] | None:
        if params.logprobs is None:
            return None
        text = self.session.token_text
        return tuple(
            TokenLogprob(text(t.token_id), t.token_id, float(t.logprob),
                         tuple((text(i), float(lp)) for i, lp in (t.top_logprobs or ())))
            for t in tokens)

    async def __del__(self) -> None:
        """Graceful shutdown (scale-in, redeploy): hand the heads only this replica holds to the
        tier, so the next owner imports them instead of recomputing."""
        for due in self._export_due.values():
            due.cancel()
        if self.settings.tier_export is not TierExport.OFF:
            for (conversation_id, cache_salt), head in list(self._unexported.items()):
                await self._export_head(conversation_id, cache_salt, head)
        for task in list(self._tasks):
            task.cancel()
        self.session.shutdown()
        if self._client is not None:
            await self._client.close()
