"""Server-sent event chunks of one choice, in OpenAI's shapes: `ChoiceStream` turns a choice's
deltas into `text_completion` / `chat.completion.chunk` records (with logprobs, echo, tool calls),
and the route interleaves the choices of a request as their tokens arrive (each chunk names its
choice's `index`, as OpenAI's do)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serving.openai import convert, tool_calls
from serving.openai.logprobs import CompletionLogprobs, chat_logprobs
from serving.openai.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from collections.abc import Sequence

    from serving.orchestrator import Completion, Delta, RequestHandle
    from serving.text.tokenizer import Tokenizer


class ChoiceStream:
    """One choice's chunks. Chat with tools to call holds its text back: whether the reply is
    content or tool calls is known at its end."""

    def __init__(
        self,
        body: convert.OpenAIRequest,
        header: tuple[str, int, str],
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        handle: RequestHandle,
    ):
        self.body, self.header, self.tokenizer = body, header, tokenizer
        self.prompt_ids, self.handle, self.index = prompt_ids, handle, handle.choice
        self.chat = isinstance(body, ChatCompletionRequest)
        self.hold = self.chat and tool_calls.calling(body)
        self.echoed = False
        self.completion_logprobs = (
            CompletionLogprobs(tokenizer, body.logprobs)
            if not self.chat and body.logprobs is not None
            else None
        )

    def opening(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [convert.chat_chunk(*self.header, {"role": "assistant", "content": ""}, None, self.index)]

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        if self.chat:
            if self.hold:
                return []
            logprobs = None
            if self.body.logprobs:
                logprobs = chat_logprobs(self.tokenizer, delta.logprobs or [], self.body.top_logprobs or 0)
            return [convert.chat_chunk(*self.header, {"content": delta.text}, None, self.index, logprobs)]
        out = self._echo()
        logprobs = None
        if self.completion_logprobs is not None:
            logprobs = self.completion_logprobs.chunk(delta.logprobs or [], delta.token_ids)
        out.append(convert.completion_chunk(*self.header, delta.text, None, self.index, logprobs))
        return out

    def final(self, c: Completion) -> list[dict[str, Any]]:
        """The chunks after the last delta: held text or tool calls, then the finish reason."""
        if not self.chat:
            return [*self._echo(), convert.completion_chunk(*self.header, "", c.finish_reason, self.index)]
        out, finish_reason = [], c.finish_reason
        if self.hold:
            choice = convert.chat_choice(self.body, c, self.tokenizer)
            message, finish_reason = choice["message"], choice["finish_reason"]
            if message.get("tool_calls"):
                calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                out.append(convert.chat_chunk(*self.header, {"tool_calls": calls}, None, self.index))
            elif c.text:
                delta = {"content": c.text}
                out.append(convert.chat_chunk(*self.header, delta, None, self.index, choice["logprobs"]))
        out.append(convert.chat_chunk(*self.header, {}, finish_reason, self.index))
        return out

    def _echo(self) -> list[dict[str, Any]]:
        """Completions with echo: the prompt (and its logprobs) before the first new text."""
        if self.chat or not self.body.echo or self.echoed:
            return []
        self.echoed = True
        logprobs = None
        if self.completion_logprobs is not None:
            entries = self.handle.prompt_logprobs or (None,) * len(self.prompt_ids)
            logprobs = self.completion_logprobs.chunk(entries, self.prompt_ids)
        text = convert.echo_text(self.tokenizer, self.prompt_ids)
        return [convert.completion_chunk(*self.header, text, None, self.index, logprobs)]
