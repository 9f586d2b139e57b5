"""Request bodies of the HTTP API: JetStream's /generate and OpenAI's completions and chat.

Validation happens here, before a request reaches the orchestrator; anything pydantic rejects becomes
a 400 in OpenAI's error shape naming the field. Fields OpenAI defines that we do not implement are
accepted at their neutral value and rejected clearly otherwise, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI allows up to 4 stop sequences; vLLM more. Keep it bounded: each is searched per token.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256

Stop = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); NaN and infinities are rejected.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Sampling(_Body):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1: no top-k cut (vLLM extension)")
    seed: Seed | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = Field(
        default=False, description="keep generating past end-of-sequence (vLLM extension)"
    )

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class GenerateRequest(_Sampling):
    """JetStream's POST /generate (plus our sampling fields). Greedy unless a temperature is given."""

    prompt: str = Field(max_length=1 << 20)
    max_tokens: int = Field(default=64, ge=1)
    stream: bool = False


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAI(_Sampling):
    model: str | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> _OpenAI:
        if self.n != 1:
            raise ValueError("n: only n=1 is supported (send several requests instead)")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self


class CompletionRequest(_OpenAI):
    """OpenAI's POST /v1/completions; one prompt: text or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(max_length=1 << 20)
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise ValueError(f"prompt: one prompt per request (got a batch of {len(prompt)})")
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAI):
    """OpenAI's POST /v1/chat/completions; the prompt is the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    tools: list[dict] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
