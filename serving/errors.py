"""Errors of the runtime that a user can fix; the CLI prints them without a traceback."""


class GenerationError(ValueError):
    """A request that cannot be served as asked (empty prompt, too long, bad sampling values)."""


class QueueFullError(RuntimeError):
    """The admission queue is full; try again later."""


class ShuttingDownError(RuntimeError):
    """The orchestrator no longer accepts requests."""
