"""Typed errors raised at the engine's boundaries."""


class EngineError(Exception):
    """Base class of every error the engine reports to its callers."""


class UnsupportedModelError(EngineError):
    """The checkpoint asks for something this engine does not implement; names the field."""

    def __init__(self, field: str, value: object, why: str):
        super().__init__(f"unsupported model config: {field}={value!r}: {why}")
        self.field = field


class CheckpointError(EngineError):
    """The checkpoint directory is missing files or holds tensors of the wrong shape."""


class InvalidRequestError(EngineError):
    """The request itself is bad (too long, invalid sampling parameters, unknown tokens)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt exceeds the model's length limit or could never fit the KV cache (HTTP 413)."""


class OutOfCacheError(EngineError):
    """The KV block pool or the Mamba state pool cannot hold what was asked for."""


class ConversationBusyError(EngineError):
    """A turn of this conversation is already in flight."""


class ConversationNotFoundError(EngineError):
    """No such conversation under this (conversation_id, cache_salt), or no such turn."""


class CorruptStateError(EngineError):
    """An exported head failed its checksums or does not fit this engine's model and layout."""


class PrefixMismatchError(CorruptStateError):
    """A prefix checkpoint (sound in itself) covers other tokens than the prompt it was fetched
    for begins with: the same messages rendered otherwise (another chat_template_kwargs)."""

    def __init__(self, message: str, length: int, digest: str):
        super().__init__(message)
        self.length, self.digest = length, digest


class RequestIdInUseError(InvalidRequestError):
    """A request with this id is already running or streaming."""


class EngineShutdownError(EngineError):
    """The engine was shut down before the call or stream completed."""


class TurnResolvedError(EngineError):
    """A prepared turn was already committed, abandoned or expired (or is not this engine's)."""


class HistoryRewriteError(InvalidRequestError):
    """The chat template cannot render the new messages as an append to the committed tokens."""


class HeadExistsError(EngineError):
    """A commit found another head already published for its turn; nothing was changed."""
