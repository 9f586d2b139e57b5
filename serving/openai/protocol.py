"""Request bodies of the HTTP API: JetStream's /generate and OpenAI's completions and chat.

Validation happens here, before a request reaches the orchestrator; anything pydantic rejects becomes
a 400 in OpenAI's error shape naming the field. Fields OpenAI defines that we do not implement are
accepted at their neutral value and rejected clearly otherwise, never silently ignored. Fields no
type here defines are kept aside (`model_extra`) for serving.openai.fields to refuse or count.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serving.request import MAX_LOGPROBS

# OpenAI allows up to 4 stop sequences; vLLM more. Keep it bounded: each is searched per token.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_CHOICES = 128  # n; the engine's slot count is the real bound (a 400 past it)

Stop = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Body(BaseModel):
    # Unknown fields are kept for serving.openai.fields, which refuses them by default (the schema
    # says so) or, with unknown_request_fields=warn, counts them; NaN and infinities are rejected.
    model_config = ConfigDict(
        extra="allow", allow_inf_nan=False, json_schema_extra={"additionalProperties": False}
    )


class _Sampling(_Body):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1: no top-k cut (vLLM extension)")
    seed: Seed | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = Field(
        default=False, description="keep generating past end-of-sequence (vLLM extension)"
    )
    speculative: bool = Field(
        default=True, description="false: no speculative decoding for this request (pathserve extension)"
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


class JsonSchema(_Body):
    name: str = Field(default="schema", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        return self


class _OpenAI(_Sampling):
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    response_format: ResponseFormat | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> _OpenAI:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if self.ignore_eos and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("ignore_eos: cannot be combined with response_format (its grammar ends at end of sequence)")
        return self


class CompletionRequest(_OpenAI):
    """OpenAI's POST /v1/completions; one prompt: text or token ids."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(max_length=1 << 20)
    max_tokens: int | None = Field(default=16, ge=0, description="0 with echo: score the prompt")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise ValueError(f"prompt: one prompt per request (got a batch of {len(prompt)})")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (to score the prompt)")
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


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_OpenAI):
    """OpenAI's POST /v1/chat/completions; the prompt is the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool is named {choice.function.name!r} (tools: {names})")
        calls_tools = self.effective_tool_choice() != "none"
        if calls_tools and self.response_format and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with tools unless tool_choice is none")
        if self.tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
            if self.ignore_eos:
                raise ValueError("ignore_eos: cannot be combined with a tool_choice that must call a tool")
            if self.stop_strings():
                raise ValueError("stop: cannot be combined with a tool_choice that must call a tool (it could cut the arguments)")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LoadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter: serve the PEFT adapter at `lora_path` as model `lora_name`."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter (`lora_path` accepted and unused, as vLLM does)."""

    lora_name: str = Field(min_length=1)
    lora_path: str | None = None
