// The playground's HTTP calls: OpenAI's /v1 routes with an optional bearer key, errors made readable,
// and the chat stream's server-sent events read from fetch (EventSource cannot POST).
// Every URL is relative, so the page works wherever the server is mounted.

const REASONS = {
  400: "bad request",
  401: "unauthorized",
  404: "not found",
  413: "request too large",
  429: "too many requests",
  499: "client closed the request",
  500: "server error",
  503: "unavailable",
};

/** An API answer that was not 2xx, with the server's OpenAI-style message. */
export class APIError extends Error {
  constructor(status, message, type, param, retryAfter) {
    super(message);
    this.status = status;
    this.type = type;
    this.param = param;
    this.retryAfter = retryAfter;
  }

  /** One line a person can read: "Error 429 (too many requests): the queue is full — retry in 1 s". */
  describe() {
    const reason = REASONS[this.status] || this.type || "error";
    let text = `Error ${this.status} (${reason}): ${this.message}`;
    if (this.retryAfter) text += ` — retry in ${this.retryAfter} s`;
    return text;
  }
}

/** The headers of an API call: JSON, plus the bearer key when one is set. */
function headers(key, json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  if (key) out.Authorization = `Bearer ${key}`;
  return out;
}

/** An APIError from a non-2xx response, whatever its body holds. */
async function errorOf(response) {
  const text = await response.text();
  let message = text.trim() || response.statusText || "no message";
  let type = null;
  let param = null;
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) ({ message, type = null, param = null } = error);
  } catch {
    // not JSON (a proxy's page): the text itself is the message
  }
  return new APIError(response.status, message, type, param, response.headers.get("Retry-After"));
}

/** fetch, turning a network failure into an error that says the server could not be reached. */
async function call(path, options) {
  try {
    return await fetch(path, options);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new Error(`Could not reach the server (${err.message})`);
  }
}

/** GET v1/models: the served model's id; throws APIError (401 without the right key, 503 while loading). */
export async function modelName(key) {
  const response = await call("v1/models", { headers: headers(key, false) });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()).data[0].id;
}

/**
 * POST v1/chat/completions with stream=true; calls onDelta(text) for each piece of the reply and
 * returns {finishReason, usage} once the server sends [DONE]. `signal` aborts it (Stop).
 */
export async function streamChat(body, key, signal, onDelta) {
  const request = { ...body, stream: true, stream_options: { include_usage: true } };
  const response = await call("v1/chat/completions", {
    method: "POST",
    headers: headers(key, true),
    body: JSON.stringify(request),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const result = { finishReason: null, usage: null };
  for await (const data of events(response.body)) {
    if (data === "[DONE]") return result;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new APIError(500, chunk.error.message, chunk.error.type); // failed mid-stream
    if (chunk.usage) result.usage = chunk.usage;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) continue;
    if (choice.delta && choice.delta.content) onDelta(choice.delta.content);
    if (choice.finish_reason) result.finishReason = choice.finish_reason;
  }
  throw new Error("the stream ended before [DONE] (the server closed the connection)");
}

/** The `data:` payloads of a server-sent event stream, one string per event. */
async function* events(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}
