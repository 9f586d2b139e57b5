"""Locust users for pathserve (or any JetStream / OpenAI-compatible server).

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s --csv results/locust

Users: JetStream `/generate` (whole and streamed), OpenAI `/v1/completions` and
`/v1/chat/completions` (streamed). Every streamed request also records its time to first token as
its own entry (type `TTFT`); the main entry's response length is the number of output tokens
reported by the server's `usage`. Prompts come from `--dataset` (a ShareGPT JSON file) or a
reproducible synthetic set (`--seed`, `--max-prompt-words`, `--max-output-tokens`).
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

from loadtest import dataset

_PROMPTS: list[dataset.Prompt] = []


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    parser.add_argument("--dataset", default="", help="a ShareGPT JSON file (default: synthetic prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-words", type=int, default=200)
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--api-key", default=os.environ.get("PATHSERVE_API_KEY", ""))


@events.init.add_listener
def _load_prompts(environment, **_) -> None:
    options = environment.parsed_options
    if options is None:
        return
    _PROMPTS[:] = dataset.load(
        options.dataset or None, 512, options.seed, options.max_prompt_words, options.max_output_tokens
    )


class _User(HttpUser):
    abstract = True
    wait_time = between(0.0, 0.5)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options and options.api_key else {}
        self.rng = random.Random()
        with self.client.get("/v1/models", headers=self.headers, name="/v1/models", catch_response=True) as r:
            self.model = r.json()["data"][0]["id"] if r.status_code == 200 else None

    def prompt(self) -> dataset.Prompt:
        return self.rng.choice(_PROMPTS)

    def _ttft(self, name: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type="TTFT",
            name=name,
            response_time=seconds * 1000,
            response_length=0,
            exception=None,
            context={},
        )

    def _stream(self, path: str, name: str, body: dict, text_of) -> None:
        """POST a streamed request; its entry spans the whole stream, its length is the output tokens
        from `usage`, and the time to the first text is recorded as a TTFT entry of the same name."""
        started = time.perf_counter()
        first = None
        tokens = 0
        complete = False  # saw the end of the stream: [DONE], or JetStream's final record
        with self.client.post(
            path, json=body, headers=self.headers, name=name, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            try:
                for raw in response.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if line.strip() == "data: [DONE]":
                        complete = True
                        continue
                    record = _record(line)
                    if record is None:
                        continue
                    if first is None and text_of(record):
                        first = time.perf_counter() - started
                    tokens = _usage_tokens(record) or tokens
                    complete = complete or "response" in record
            except (ValueError, OSError) as exc:
                response.failure(f"broken stream: {exc}")
                return
            response.request_meta["response_time"] = (time.perf_counter() - started) * 1000
            response.request_meta["response_length"] = tokens
            if not complete:
                response.failure("the stream ended before its final record")
                return
            response.success()
        if first is not None:  # an empty completion (end of sequence first) has no first token
            self._ttft(name, first)


def _record(line: str | bytes) -> dict | None:
    line = (line.decode() if isinstance(line, bytes) else line).strip()
    if not line:
        return None
    return json.loads(line.removeprefix("data: "))


def _usage_tokens(record: dict) -> int:
    usage = record.get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


class JetStreamUser(_User):
    """JetStream's POST /generate, whole and streamed (JSON lines)."""

    @task
    def generate(self) -> None:
        p = self.prompt()
        body = {"prompt": p.text, "max_tokens": p.max_tokens}
        with self.client.post("/generate", json=body, headers=self.headers, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            r.request_meta["response_length"] = _usage_tokens(r.json())
            r.success()

    @task
    def generate_stream(self) -> None:
        p = self.prompt()
        body = {"prompt": p.text, "max_tokens": p.max_tokens, "stream": True}
        self._stream("/generate", "/generate [stream]", body, lambda r: r.get("text"))


class CompletionsUser(_User):
    """OpenAI POST /v1/completions, streamed with usage."""

    @task
    def completion_stream(self) -> None:
        p = self.prompt()
        body = {
            "model": self.model,
            "prompt": p.text,
            "max_tokens": p.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._stream(
            "/v1/completions",
            "/v1/completions [stream]",
            body,
            lambda r: any(c.get("text") for c in r.get("choices", [])),
        )


class ChatUser(_User):
    """OpenAI POST /v1/chat/completions, streamed with usage."""

    @task
    def chat_stream(self) -> None:
        p = self.prompt()
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": p.text}],
            "max_tokens": p.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._stream(
            "/v1/chat/completions",
            "/v1/chat/completions [stream]",
            body,
            lambda r: any((c.get("delta") or {}).get("content") for c in r.get("choices", [])),
        )
