"""From JetStream's DecodeRequest to what the orchestrator takes, and from its deltas back to
DecodeResponse messages. Every refusal names the request field at fault, as the HTTP API does.

JetStream's rules carry over: `text_content` is tokenized here and answered with text and token
ids; `token_content` comes from a client that tokenized itself and is answered with token ids only
(the client detokenizes). `has_bos` says the content already begins with the beginning-of-sequence
token; otherwise it is added where the tokenizer's rule adds one (never twice). There are no
sampling fields in the proto, so decoding samples as the server's MaxText decode_sampling_* keys say
(greedy by default, as MaxText's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet

from serving.errors import GenerationError, RequestFailed
from serving.grpc import jetstream_pb2 as pb
from serving.request import SamplingParams

if TYPE_CHECKING:
    from serving.config import ServerConfig
    from serving.text.tokenizer import Tokenizer

TEXT_FIELD = "text_content.text"
TOKENS_FIELD = "token_content.token_ids"


class RequestError(Exception):
    """A request answered with `code` and `message` (which starts with the field at fault)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def invalid(field: str, problem: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    field: str  # TEXT_FIELD or TOKENS_FIELD: where errors about the prompt point
    text_out: bool  # answer with text (server-side tokenization) or token ids only


# The fields older JetStream clients may still send (v0.2.x's DecodeRequest; JetStream reserves
# their numbers now). proto3 leaves a field at its default off the wire, so one that arrives was set.
RETIRED_FIELDS = {1: "session_cache", 2: "additional_text", 3: "priority"}


def check_supported(request: pb.DecodeRequest) -> None:
    """Refuse what this server does not do, rather than silently doing something else: an
    unknown field that arrived (an older client's session_cache or priority set; protobuf keeps
    such fields on the message) as much as num_samples above 1."""
    unknown = sorted({f.field_number for f in UnknownFieldSet(request)})
    if unknown:
        names = ", ".join(RETIRED_FIELDS.get(n, f"field {n}") for n in unknown)
        raise invalid(
            names.split(", ")[0],
            f"not supported here: {names} (JetStream's older DecodeRequest fields; "
            "send the request without them)",
        )
    if request.num_samples < 0:
        raise invalid("num_samples", f"must be 0 or 1, got {request.num_samples}")
    if request.num_samples > 1:
        raise RequestError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"num_samples: one sample per request is supported, got {request.num_samples} "
            "(send that many requests instead)",
        )


def prompt(request: pb.DecodeRequest, tokenizer: Tokenizer) -> Prompt:
    """The prompt's token ids, with the beginning-of-sequence token as `has_bos` and the tokenizer say."""
    which = request.WhichOneof("content")
    if which == "text_content":
        text = request.text_content.text
        if not text:
            raise invalid(TEXT_FIELD, "the prompt is empty")
        ids = tokenizer.encode(text) if request.has_bos else tokenizer.encode_prompt(text)
        return Prompt(ids, TEXT_FIELD, text_out=True)
    if which == "token_content":
        ids = list(request.token_content.token_ids)
        if not ids:
            raise invalid(TOKENS_FIELD, "the prompt is empty")
        bad = next((i for i in ids if not 0 <= i < tokenizer.vocab_size), None)
        if bad is not None:
            raise invalid(
                TOKENS_FIELD, f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})"
            )
        return Prompt(ids if request.has_bos else _with_bos(tokenizer, ids), TOKENS_FIELD, text_out=False)
    raise invalid("content", "set text_content or token_content")


def _with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and ids[:1] != [bos]:
        return [bos, *ids]
    return ids


def sampling(request: pb.DecodeRequest, tokenizer: Tokenizer, config: ServerConfig | None = None) -> SamplingParams:
    """Decoding of max_tokens tokens as the server's MaxText decode_sampling_* keys say (greedy
    without them: the proto has no sampling fields), ending early at the model's end-of-sequence
    tokens, with the LoRA adapter `lora_adapter_id` names (empty: the base model)."""
    if request.max_tokens <= 0:
        raise invalid("max_tokens", f"must be positive, got {request.max_tokens}")
    adapter = request.lora_adapter_id or None
    return SamplingParams(
        max_tokens=request.max_tokens, stop_ids=tokenizer.eos_ids, adapter=adapter,
        **(config.decode_sampling() if config is not None else {}),
    )


def refusal(exc: GenerationError, prompt: Prompt) -> RequestError:
    """The orchestrator's verdict on a request (too long, over max_target_length) as a gRPC error."""
    field = prompt.field if exc.field == "prompt" else exc.field or "request"
    return invalid(field, str(exc))


def response(text: str, token_ids: Sequence[int]) -> pb.DecodeResponse:
    """One streamed message with one sample."""
    sample = pb.DecodeResponse.StreamContent.Sample(text=text, token_ids=token_ids)
    return pb.DecodeResponse(stream_content=pb.DecodeResponse.StreamContent(samples=[sample]))


def failed(error: RequestFailed) -> RequestError:
    """A request the server could not finish, as the call's status: INTERNAL when the engine failed
    under it, NOT_FOUND when its adapter was unloaded before it was served (a short stream never
    ends OK)."""
    if error.kind == "adapter":
        return RequestError(grpc.StatusCode.NOT_FOUND, f"lora_adapter_id: {error}")
    return RequestError(grpc.StatusCode.INTERNAL, str(error))
