// The status strip: readiness from /readyz, slots in use and queue length from /metrics.
// Both are open routes (no API key); the strip refreshes every POLL_MS while the page is visible,
// and at once when a reply ends (an error such as a 429 or 503 is seen with the state behind it).

const POLL_MS = 2000;

/** The samples of a Prometheus text exposition: name -> number, the first series of each name
 * whatever its labels (the jetstream_* gauges carry JetStream's id and model_name). */
export function parseMetrics(text) {
  const values = new Map();
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)$/.exec(line);
    if (match && !values.has(match[1])) values.set(match[1], Number(match[2]));
  }
  return values;
}

/** {ready, text} from /readyz: its status says why it is not ready (starting, draining, queue full). */
async function readiness() {
  try {
    const response = await fetch("readyz", { cache: "no-store" });
    const body = await response.json();
    return { ready: response.ok, text: body.status || String(response.status) };
  } catch {
    return { ready: false, text: "unreachable" };
  }
}

async function metrics() {
  try {
    const response = await fetch("metrics", { cache: "no-store" });
    return response.ok ? parseMetrics(await response.text()) : new Map();
  } catch {
    return new Map();
  }
}

function show(element, text, state) {
  element.textContent = text;
  element.dataset.state = state;
}

/** Fill the strip's three pills once. */
export async function refresh(elements) {
  const [probe, values] = await Promise.all([readiness(), metrics()]);
  show(elements.ready, probe.ready ? "ready" : `not ready: ${probe.text}`, probe.ready ? "ok" : "bad");
  const active = values.get("pathserve_active_slots");
  const total = values.get("pathserve_total_slots");
  const queued = values.get("jetstream_prefill_backlog_size");
  show(elements.slots, total === undefined ? "slots –" : `slots ${active}/${total}`, active < total ? "ok" : "busy");
  show(elements.queue, queued === undefined ? "queue –" : `queue ${queued}`, queued ? "busy" : "ok");
}

/** Refresh now and every POLL_MS (skipped while the tab is hidden); returns a refresh-now function. */
export function watch(elements) {
  const now = () => refresh(elements);
  setInterval(() => document.visibilityState !== "hidden" && now(), POLL_MS);
  now();
  return now;
}
