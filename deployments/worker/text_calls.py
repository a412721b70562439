"""The worker's calls that only render and tokenize (any replica answers them, no engine step):
/tokenize, /detokenize, conversation items' token ids, and the model's context length. A mixin
of `Worker` (replica.py): Serve calls them as the deployment's methods."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.worker.session import Session
from workers.conversation.prompt import appended_ids
from workers.errors import InvalidRequestError
from workers.template_options import TemplateOptions
from workers.tools.formats import plain_message


class TextCalls:
    session: Session

    async def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                       template: TemplateOptions) -> tuple[list[int], str]:
        """(ids, "") or ([], why the messages cannot be rendered): a 400 at the ingress."""
        try:
            return await self.session.tokenize(prompt, messages, template), ""
        except InvalidRequestError as e:  # a template that refuses the messages
            return [], str(e)

    async def detokenize(self, token_ids: list[int]) -> tuple[str, str]:
        """(text, "") or ("", why these are not token ids of the model): a 400 at the ingress."""
        try:
            return await self.session.detokenize(token_ids), ""
        except InvalidRequestError as e:
            return "", str(e)

    async def appended_ids(self, committed_ids: list[int], history: list[dict[str, Any]],
                           items: list[dict[str, Any]]) -> tuple[list[int], list[dict[str, Any]], str]:
        """Items appended to a conversation without a reply (POST /v1/conversations/{id}/items):
        (their token ids, the messages as the ledger keeps them, "") or ([], [], why they cannot
        follow this history): a 400 at the ingress. Any replica: it only renders and tokenizes."""
        items = [plain_message(m, self.session.tool_format) for m in items]  # as a turn's suffix
        try:
            ids = await asyncio.to_thread(appended_ids, self.session.tokenizer, committed_ids, history, items)
        except InvalidRequestError as e:  # a template that refuses them, or would rewrite history
            return [], [], str(e)
        return ids, items, ""

    async def max_model_len(self) -> int:
        """The longest prompt + reply this replica's engine takes (GET /v1/models)."""
        return await self.session.max_model_len()
