"""Errors a user can fix. Every such error derives from `UserError`; the CLI and the server print
them without a traceback (one base class, so neither has to list every package's errors)."""

from __future__ import annotations

from collections.abc import Iterable


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


class RequestFailed(RuntimeError):
    """A request the server could not finish: the device loop failed under it (`kind` "engine":
    an XLA or kernel error, out of memory; its traceback is in the log), or the LoRA adapter it
    names was unloaded while it waited in the queue (`kind` "adapter"). The front-ends answer it as
    an error (HTTP 500 or 404, gRPC INTERNAL or NOT_FOUND, an error event in a stream, no batch
    record), never as a completion cut short."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# The finish reasons of a request the server could not finish (`failure` says what to answer).
ENGINE_FAILED = "error"  # the device loop failed under it
ADAPTER_UNLOADED = "adapter_unloaded"  # its LoRA adapter was unloaded while it waited in the queue


def failure(finish_reasons: Iterable[str]) -> RequestFailed | None:
    """The error to answer instead of a request's choices that ended with `finish_reasons`, if
    any of them did not finish; None when every one did (stop, length or cancelled)."""
    reasons = set(finish_reasons)
    if ENGINE_FAILED in reasons:
        return RequestFailed("engine", "the engine failed while generating this request (the log says why)")
    if ADAPTER_UNLOADED in reasons:
        return RequestFailed("adapter", "the LoRA adapter this request names was unloaded before the request was served")
    return None
