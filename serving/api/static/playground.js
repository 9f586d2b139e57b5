// The chat playground: a conversation sent to /v1/chat/completions and streamed back, with the
// sampling controls, Stop and Regenerate, and under each reply its time to first token, decode rate
// and token counts. The API key (when the server wants one) lives in this tab's sessionStorage.

import { APIError, modelName, streamChat } from "./api.js";
import { watch } from "./status.js";

const KEY_STORAGE = "pathserve.apiKey";
const RETRY_MODEL_MS = 2000;

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"),
  keyForm: $("key-form"),
  keyInput: $("api-key"),
  keyError: $("key-error"),
  system: $("system"),
  temperature: $("temperature"),
  topP: $("top-p"),
  maxTokens: $("max-tokens"),
  seed: $("seed"),
  messages: $("messages"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  regenerate: $("regenerate"),
  clear: $("clear"),
};

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  model: null,
  turns: [], // {role: "user" | "assistant", content, node}
  failed: null, // the last reply's node when it failed (Regenerate replaces it)
  controller: null, // the AbortController of the reply being streamed
};

// -- model and key --------------------------------------------------------------------------

async function loadModel() {
  try {
    state.model = await modelName(state.key);
    ui.model.textContent = `model: ${state.model}`;
    ui.keyForm.hidden = true;
    ui.keyError.hidden = true;
  } catch (err) {
    if (err instanceof APIError && err.status === 401) {
      askForKey(err);
    } else {
      ui.model.textContent = err instanceof APIError && err.status === 503 ? "model: loading…" : "model: unreachable";
      setTimeout(loadModel, RETRY_MODEL_MS);
    }
  }
}

/** Show the key form; with a key already given, the 401's message says it was wrong. */
function askForKey(err) {
  ui.model.textContent = "model: (API key needed)";
  ui.keyForm.hidden = false;
  ui.keyError.hidden = !state.key;
  ui.keyError.textContent = state.key ? err.describe() : "";
  ui.keyInput.focus();
}

ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = ui.keyInput.value.trim();
  sessionStorage.setItem(KEY_STORAGE, state.key);
  loadModel();
});

// -- the conversation -----------------------------------------------------------------------

function addMessage(role, text) {
  const node = document.createElement("li");
  node.className = `message ${role}`;
  node.innerHTML = '<div class="role"></div><div class="content"></div>';
  node.querySelector(".role").textContent = role;
  node.querySelector(".content").textContent = text;
  ui.messages.append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

/** The request's sampling fields; an empty control is left out (the server's default applies). */
function sampling() {
  const body = {};
  const fields = [
    ["temperature", ui.temperature, Number],
    ["top_p", ui.topP, Number],
    ["max_tokens", ui.maxTokens, Number],
    ["seed", ui.seed, Number],
  ];
  for (const [name, input, parse] of fields) {
    if (input.value.trim() !== "") body[name] = parse(input.value);
  }
  return body;
}

function requestBody() {
  const messages = [];
  const system = ui.system.value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const turn of state.turns) messages.push({ role: turn.role, content: turn.content });
  const body = { messages, ...sampling() };
  if (state.model) body.model = state.model;
  return body;
}

/**
 * The figures under a reply. TTFT: from sending to the first piece of text. tok/s: the decode rate,
 * tokens after the first over the time after the first. Counts from the stream's `usage`.
 */
function showStats(node, timing, result, stopped) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const usage = result && result.usage;
  const completion = usage ? usage.completion_tokens : timing.pieces;
  const parts = [];
  if (timing.first !== null) {
    const ttft = timing.first - timing.start;
    node.dataset.ttftMs = ttft.toFixed(0);
    parts.push(["ttft", `TTFT ${ttft.toFixed(0)} ms`]);
    const seconds = (timing.end - timing.first) / 1000;
    if (completion > 1 && seconds > 0) {
      const rate = (completion - 1) / seconds;
      node.dataset.tokensPerS = rate.toFixed(1);
      parts.push(["rate", `${rate.toFixed(1)} tok/s`]);
    }
  }
  if (usage) {
    node.dataset.completionTokens = usage.completion_tokens;
    node.dataset.promptTokens = usage.prompt_tokens;
    parts.push(["tokens", `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`]);
  } else {
    parts.push(["tokens", `~${timing.pieces} completion tokens`]);
  }
  parts.push(["finish", stopped ? "stopped" : result.finishReason || "?"]);
  for (const [cls, text] of parts) {
    const span = document.createElement("span");
    span.className = cls;
    span.textContent = text;
    stats.append(span);
  }
  node.append(stats);
}

function showError(node, err) {
  node.classList.add("error");
  node.dataset.state = "error";
  const message = document.createElement("div");
  message.className = "error-text";
  message.setAttribute("role", "alert");
  message.textContent = err instanceof APIError ? err.describe() : err.message;
  node.append(message);
  state.failed = node;
  if (err instanceof APIError && err.status === 401) askForKey(err);
}

async function reply() {
  const body = requestBody();
  const node = addMessage("assistant", "");
  node.dataset.state = "streaming";
  const content = node.querySelector(".content");
  const timing = { start: performance.now(), first: null, end: null, pieces: 0 };
  let text = "";
  state.controller = new AbortController();
  setBusy(true);
  try {
    const result = await streamChat(body, state.key, state.controller.signal, (delta) => {
      if (timing.first === null) timing.first = performance.now();
      timing.pieces += 1;
      text += delta;
      content.textContent = text;
      node.scrollIntoView({ block: "end" });
    });
    timing.end = performance.now();
    if (result.finishReason === "error") throw new Error("The server failed while generating this reply (finish_reason: error)");
    state.turns.push({ role: "assistant", content: text, node });
    showStats(node, timing, result, false);
    node.dataset.state = "done";
  } catch (err) {
    timing.end = performance.now();
    if (err.name === "AbortError") {
      if (text) state.turns.push({ role: "assistant", content: text, node });
      else state.failed = node;
      showStats(node, timing, null, true);
      node.dataset.state = "stopped";
    } else {
      showError(node, err);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    refreshStatus();
  }
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.clear.disabled = busy;
  const last = state.turns.at(-1);
  ui.regenerate.disabled = busy || (!state.failed && !(last && last.role === "assistant"));
}

async function send() {
  const text = ui.prompt.value.trim();
  if (!text || state.controller) return;
  ui.prompt.value = "";
  dropFailed();
  state.turns.push({ role: "user", content: text, node: addMessage("user", text) });
  await reply();
}

function dropFailed() {
  if (state.failed) state.failed.remove();
  state.failed = null;
}

/** Replace the last reply (or the failed attempt) with a new one for the same conversation. */
async function regenerate() {
  if (state.controller) return;
  if (state.failed) {
    dropFailed();
  } else if (state.turns.at(-1)?.role === "assistant") {
    state.turns.pop().node.remove();
  }
  if (state.turns.at(-1)?.role === "user") await reply();
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => state.controller && state.controller.abort());
ui.regenerate.addEventListener("click", regenerate);
ui.clear.addEventListener("click", () => {
  state.turns = [];
  state.failed = null;
  ui.messages.replaceChildren();
  setBusy(false);
});

// On a narrow screen the settings start folded, so the conversation comes first.
if (window.matchMedia("(max-width: 720px)").matches) $("settings").open = false;
const refreshStatus = watch({ ready: $("status-ready"), slots: $("status-slots"), queue: $("status-queue") });
loadModel();
setBusy(false);
