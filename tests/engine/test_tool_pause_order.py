"""The eviction order of the head manager with tool pauses: a state waiting for its tools'
results goes last, until its results came back (a request attached it, or a longer link
superseded it) or its pause ran out. (What a mark spares of them: test_prefix_checkpoints.)"""

from __future__ import annotations

import time

import pytest

from workers.cache.heads import CommittedHead, HeadManager
from workers.config import CacheConfig
from workers.state_names import Holder, HolderKind, PrefixKey


def _manager(pause_s: float) -> HeadManager:
    return HeadManager(None, None, 1 << 30, 60.0, 1 << 30, 8, tool_pause_s=pause_s)


def _checkpoint(manager: HeadManager, n: int, age_s: float, **flags) -> CommittedHead:
    head = CommittedHead(Holder(HolderKind.CHECKPOINT, n), "", 0, 0, 16, 0, prefix=PrefixKey("s", 16 + n, str(n)),
                         last_used=time.monotonic() - age_s, **flags)
    manager.checkpoints[head.holder] = head
    return head


def test_paused_states_go_last_until_their_results_came_back():
    manager = _manager(pause_s=300.0)
    waiting = _checkpoint(manager, 1, age_s=100, awaiting_tool=True, chain_end=True)
    old = _checkpoint(manager, 2, age_s=50)
    resumed = _checkpoint(manager, 3, age_s=90, awaiting_tool=True, chain_end=True, hits=1)
    expired = _checkpoint(manager, 4, age_s=400, awaiting_tool=True, chain_end=True)
    spent = _checkpoint(manager, 5, age_s=10, awaiting_tool=True, chain_end=True, superseded=True, hits=1)
    order = manager.eviction_order(HolderKind.CHECKPOINT)
    assert order == [spent, expired, resumed, old, waiting]
    assert _manager(pause_s=0.0).eviction_order(None) == []
    off = _manager(pause_s=0.0)
    off.checkpoints = manager.checkpoints
    assert off.eviction_order(HolderKind.CHECKPOINT) == [spent, expired, waiting, resumed, old]


def test_the_tool_pause_share_is_a_fraction_of_the_budget():
    assert CacheConfig().tool_pause_share == 0.5
    for share in (0.0, 1.0):
        assert CacheConfig(tool_pause_share=share).tool_pause_share == share
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError, match="tool_pause_share"):
            CacheConfig(tool_pause_share=share)
