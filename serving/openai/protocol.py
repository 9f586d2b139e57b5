"""Request bodies of the HTTP API: JetStream's /generate and OpenAI's completions and chat.

Validation happens here, before a request reaches the orchestrator; anything pydantic rejects becomes
a 400 in OpenAI's error shape naming the field. Fields OpenAI defines that we do not implement are
accepted at their neutral value and rejected clearly otherwise, never silently ignored. Fields no
type here defines are kept aside (`model_extra`) for serving.openai.fields to refuse or count.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.request import LOGIT_BIAS_LIMIT, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_LOGPROBS

# OpenAI allows up to 4 stop sequences; vLLM more. Keep it bounded: each is searched per token.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_CHOICES = 128  # n; the engine's slot count is the real bound (a 400 past it)

MAX_STOP_TOKEN_IDS = 8  # with the model's end-of-sequence ids, within the engine's MAX_STOP_IDS

Stop = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
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
    """JetStream's POST /generate, as its HTTP sidecar takes it (plus our sampling fields). Without
    temperature, top_p and top_k, sampled as JetStream's Decode behind the sidecar is: by the
    server's MaxText decode_sampling_* keys (greedy by default). The sidecar's `session_cache` and `priority` are honoured at
    their neutral values only; its `server` and `port` name the gRPC server it forwards to, which
    this server is: accepted and named in the ignored-fields header."""

    prompt: str = Field(max_length=1 << 20)
    max_tokens: int = Field(default=100, ge=1)  # the sidecar's default
    stream: bool = False
    session_cache: str = ""
    priority: int = 0
    server: str | None = None
    port: str | None = None

    @field_validator("session_cache")
    @classmethod
    def _no_session_cache(cls, value: str) -> str:
        if value:
            raise ValueError("JetStream's session cache is not supported here (the prefix cache needs none); send it empty")
        return value

    @field_validator("priority")
    @classmethod
    def _arrival_order(cls, value: int) -> int:
        if value != 0:
            raise ValueError("requests are served in arrival order here; send 0")
        return value


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
    logit_bias: dict[str, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    # vLLM's extra parameters (serving.request.SamplingParams says what each does)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2**20)
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS // 2  # each word with and without a leading space
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="keep the last k prompt tokens; -1: max_target_length")
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _supported(self) -> _OpenAI:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if self.ignore_eos and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("ignore_eos: cannot be combined with response_format (its grammar ends at end of sequence)")
        if self.min_tokens and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("min_tokens: cannot be combined with response_format (its grammar may end sooner)")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream: true (as vLLM)")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be >= 1, or -1 for max_target_length")
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
            raise ValueError("suffix: not supported (inserting text needs a fill-in-the-middle prompt format)")
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
    """One turn. `name` and `tool_call_id` go to the chat template (serving.openai.tool_calls); an
    assistant turn replayed from OpenAI's answers may carry its `refusal` (the turn's text when it
    has no content), the deprecated `function_call` (one call, as `tool_calls` holds it) and
    `audio` (null only: this server has no audio)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers
    refusal: str | None = None
    function_call: FunctionCall | None = None
    audio: None = Field(default=None, description="null only: this server has no audio output")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or self.refusal or ""

    def calls(self) -> list[ToolCall] | None:
        """The tools this (assistant) turn called: its tool_calls, or its deprecated function_call."""
        if self.tool_calls:
            return self.tool_calls
        return [ToolCall(function=self.function_call)] if self.function_call is not None else None


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


class Prediction(_Body):
    """OpenAI's predicted output: text the answer will largely repeat (a latency hint only)."""

    type: Literal["content"]
    content: str | list[TextPart]


class ChatCompletionRequest(_OpenAI):
    """OpenAI's POST /v1/chat/completions; the prompt is the tokenizer's chat template.

    Of OpenAI's fields for its hosted service (docs/request-fields.md): `metadata`,
    `service_tier`, `prediction`, `prompt_cache_key` and `safety_identifier` are accepted and
    ignored (serving.openai.ignored says why, in a response header); `store: true`, audio output
    and `web_search_options` are refused, naming the field.
    """

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's fields for its hosted service
    store: bool | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16
    )
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prediction: Prediction | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _hosted_fields(self) -> ChatCompletionRequest:
        if self.store:
            raise ValueError("store: true is not supported: this server keeps no completions to retrieve later")
        if self.audio is not None or "audio" in (self.modalities or []):
            name = "audio" if self.audio is not None else "modalities"
            raise ValueError(f"{name}: audio output is not supported: this server generates text only")
        if self.web_search_options is not None:
            raise ValueError("web_search_options: web search is not supported: this server has no search tool")
        return self

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
            if self.min_tokens:
                raise ValueError("min_tokens: cannot be combined with a tool_choice that must call a tool")
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
