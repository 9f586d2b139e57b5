"""Errors a user can fix. Every such error derives from `UserError`; the CLI and the server print
them without a traceback (one base class, so neither has to list every package's errors)."""


class UserError(ValueError):
    """Bad input (a config key, a checkpoint, a request, a manifest): the message says what to fix."""


class ConfigError(UserError):
    """A configuration that cannot be used; the message names the offending key (serving.config)."""


class GenerationError(UserError):
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
