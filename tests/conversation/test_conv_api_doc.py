"""API.md documents every public method of the conversation facade."""

from __future__ import annotations

import inspect
from pathlib import Path

from workers.conversation.cache import ConversationCache

API = Path(__file__).resolve().parents[2] / "workers" / "conversation" / "API.md"


def test_api_md_lists_every_public_method_of_the_facade():
    text = API.read_text()
    public = [name for name, _ in inspect.getmembers(ConversationCache, inspect.isfunction) if not name.startswith("_")]
    assert len(public) > 10, public
    missing = [name for name in public if f"cc.{name}(" not in text and f"= cc.{name}(" not in text]
    assert not missing, f"not in API.md: {missing}"
