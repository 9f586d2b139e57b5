"""A streaming HTTP client for the OpenAI routes that times every token as it arrives.

TTFT is the time to the first streamed text; ITL the gaps between later text chunks; TPOT the
time after the first token divided by the tokens after it; output tokens come from the server's
`usage` (stream_options.include_usage), not from counting chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    started: float = 0.0  # perf_counter at send
    finished: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(api: str, prompt: str, max_tokens: int, model: str | None, ignore_eos: bool) -> dict:
    body: dict = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream_one(
    client: httpx.AsyncClient, url: str, api: str, body: dict, headers: dict[str, str] | None = None
) -> Result:
    """One streamed request; never raises for HTTP or protocol errors (they are in the Result)."""
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    result = Result(ok=False, started=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if api != "chat" else choice.get("delta", {}).get("content")
                    if not text:
                        continue
                    if last is None:
                        result.ttft = now - result.started
                    else:
                        result.itl.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.finished = time.perf_counter()
    result.e2e = result.finished - result.started
    result.ok = result.output_tokens > 0 or last is not None
    if not result.ok:
        result.error = "the stream carried no tokens and no usage"
    return result
