"""Conversation cache benchmark: `python -m bench.conversation [--quick]`.

C conversations x T turns on the `bench` checkpoint (random weights, written to a temp
dir): a system prompt of a few hundred tokens, user turns of ~60-100 tokens, greedy
replies of a fixed, per-turn length (temperature 0, ignore_eos). Per turn, side by side
in one run (the order of the modes rotates from turn to turn), TTFT and total time of

  (a)   the exact conversation cache: `ConversationCache.begin_turn` continues the
        committed head (terminal Mamba state at the committed length, all KV blocks);
  (b)   block-aligned reuse as vLLM's "align" mode does it, with vLLM's hybrid block size
        (the smallest multiple of 16 tokens whose attention page holds one sequence's
        Mamba state of one layer). Method: its own engine with
        CacheConfig(block_size=B, mamba_align_tokens=B) and its own ConversationCache.
        After each turn is published, the head is cut back to what align mode keeps:
        the KV table is truncated to the last full block (aligned_len = state_len // B * B)
        and the head's terminal Mamba slot is overwritten with its block-aligned snapshot
        (taken by the engine during the forward at the boundary), and head.state_len is set
        to aligned_len. The next begin_turn therefore attaches at aligned_len and the
        engine recomputes [aligned_len, committed) plus the new suffix: the same prompt
        token ids, only less reuse. The cut happens between turns, outside the timings;
  (b16) the same with B = 16 (reference);
  (c)   no reuse: a plain stateless `add_request` of (a)'s full prompt token ids;
  (d)   `transformers` `generate` (same checkpoint, greedy, same max_new_tokens) on the
        same prompt ids; TTFT = a 1-new-token generate, total = the full generate. Only
        on a few turns of the first conversation (it is slow).

TTFT = wall time from submitting the request (begin_turn / add_request included) to
the end of the first engine.step() that returns a token for it; the engine is stepped
synchronously with one conversation in flight. The machine is shared, so each mode's TTFT
is the minimum of 4 samples per turn (the median is reported too): 3 probes (submit, first
token, abort: the turn is discarded and the head untouched) and the real turn. Total =
the real turn (one sample).

Replies are exactly max_tokens tokens (ignore_eos); a greedy reply may contain
<|end_of_turn|> mid-text, which the ledger keeps (the cache still hits; `cache_stats`
and the per-mode reused/computed token counts show it).

Correctness: (a)'s greedy tokens must
equal (c)'s on every turn (recorded, and the exit status is 1 if not).

Writes bench/results/conversation.{json,md,png} (the quick run: conversation.quick.*; --smoke,
the tiny checkpoint in seconds, conversation.smoke.*; --results-dir elsewhere).
"""
