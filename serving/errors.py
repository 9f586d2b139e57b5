"""Errors of the runtime that a user can fix; the CLI prints them without a traceback."""


class GenerationError(ValueError):
    """A request that cannot be served as asked (empty prompt, too long, bad sampling values).

    `field` names the part of the request at fault ("prompt" or "max_tokens") and `code` says why
    in OpenAI's terms, so the HTTP layer and the batch runner report it without reading the message.
    """

    def __init__(self, message: str, field: str | None = None, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code


class QueueFullError(RuntimeError):
    """The admission queue is full; try again later."""


class ShuttingDownError(RuntimeError):
    """The orchestrator no longer accepts requests."""
