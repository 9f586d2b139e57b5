"""The web playground at `/` in headless Chromium (Debian's package, driven by playwright) against a
real `pathserve serve` process on the tiny random model, with an API key set.

The tests run in file order on one page, as a user would: the key prompt (a wrong key shows the
401), a streamed greedy reply equal to the same request without streaming with its TTFT, tok/s and
token counts, Regenerate, the sampling controls, Stop, a 400 shown as a message, the status strip,
a full queue's 429, a narrow screen, the browser's network log (no host but the server), and last
the SIGTERM drain's 503.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server_process import ServerProcess, metric, wait_for

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        f"Debian's chromium is not installed at {CHROMIUM}: `make test` installs it with apt-get "
        "(packages chromium and chromium-driver), which is not available or failed on this machine",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

# The machine's notes: without these Chromium reaches out to Google's hosts on its own. playwright
# starts it headless with a fresh profile (--user-data-dir in a new temporary folder) every launch.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "open-sesame"
SLOTS, QUEUE = 1, 2
# Requests that must still be running when the test acts on them (Stop, a full server) ask for this
# many tokens with ignore_eos: on the fastest machine and backend the tiny model takes seconds over
# them (each step attends over a longer window), where a click or a metrics poll takes milliseconds.
LONG = 30_000
OVERRIDES = [
    f"per_device_batch_size={SLOTS}",
    f"max_queued_requests={QUEUE}",
    "max_prefill_predict_length=64",
    f"max_target_length={LONG + 2048}",
    "enable_model_warmup=false",  # the serving profile's warmup would compile every window up to LONG
    # 4 steps a call, as the Stop test's bound counts them (the serving profile's 2 also doubles
    # the page's redraws of a reply growing to LONG tokens: Stop's click waited 60 s for a busy page).
    "decode_steps_per_call=4",
]
SYSTEM = "Be brief."
QUESTION = "Tell me about lighthouses and ships."
MAX_TOKENS = 24
TIMEOUT_MS = 60_000
expect.set_options(timeout=TIMEOUT_MS)  # a loaded CI machine can take longer than playwright's 5 s
VIOLATIONS_SCRIPT = """window.refused = [];
document.addEventListener("securitypolicyviolation", (e) => window.refused.push(e.blockedURI));"""
CANCELLED = 'pathserve_requests_finished_total{reason="cancelled"}'
FINISHED = 'pathserve_requests_finished_total{reason="length"}'
GENERATE_CALLS = "pathserve_generate_step_seconds_count"


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerProcess]:
    process = ServerProcess.pathserve(
        str(tiny_model_dir), *OVERRIDES, env={"PATHSERVE_API_KEY": KEY}
    ).wait_ready()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def requested() -> list[str]:
    """Every URL the browser asked for, across the module's pages."""
    return []


@pytest.fixture(scope="module")
def page(browser, server, requested) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    context.on("request", lambda request: requested.append(request.url))
    # A URL the Content-Security-Policy refuses is never requested: record the refusals too.
    context.add_init_script(VIOLATIONS_SCRIPT)
    context.set_default_timeout(TIMEOUT_MS)
    opened = context.new_page()
    opened.goto(server.url + "/")
    yield opened
    context.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("playground-screenshots")


def authorized(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def last_reply(page: Page):
    return page.locator("#messages li.assistant").last


def wait_finished(page: Page) -> None:
    page.wait_for_function(
        "() => { const r = [...document.querySelectorAll('#messages li.assistant')].at(-1);"
        " return r && r.dataset.state !== 'streaming'; }"
    )


def set_sampling(page: Page, temperature: str, max_tokens: int) -> None:
    page.fill("#system", SYSTEM)
    page.fill("#temperature", temperature)
    page.fill("#top-p", "1")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#seed", "")


def ask(page: Page, question: str) -> None:
    page.fill("#prompt", question)
    page.click("#send")


def test_the_page_asks_for_the_key_and_a_wrong_one_shows_the_401(page, server):
    assert httpx.get(server.url + "/").status_code == 200  # the page needs no key; the API does
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#model")).to_have_text("model: (API key needed)")
    page.fill("#api-key", "not-the-key")
    page.click("#use-key")
    expect(page.locator("#key-error")).to_contain_text(
        "Error 401 (unauthorized): a valid API key is required"
    )
    page.fill("#api-key", KEY)
    page.click("#use-key")
    model = authorized(server).get("/v1/models").json()["data"][0]["id"]
    expect(page.locator("#model")).to_have_text(f"model: {model}")
    expect(page.locator("#key-form")).to_be_hidden()


def test_a_streamed_reply_equals_the_greedy_request_and_shows_its_figures(page, server, screenshots):
    set_sampling(page, "0", MAX_TOKENS)
    ask(page, QUESTION)
    wait_finished(page)
    reply = last_reply(page)
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected = authorized(server).post(
        "/v1/chat/completions",
        json={"messages": messages, "temperature": 0, "top_p": 1, "max_tokens": MAX_TOKENS},
    )
    assert expected.status_code == 200, expected.text
    body = expected.json()
    assert reply.locator(".content").text_content() == body["choices"][0]["message"]["content"]
    stats = reply.locator(".stats").inner_text()
    assert re.search(r"TTFT \d+ ms", stats), stats
    assert re.search(r"\d+\.\d tok/s", stats), stats
    usage = body["usage"]
    assert f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens" in stats
    assert float(reply.get_attribute("data-ttft-ms")) > 0
    assert float(reply.get_attribute("data-tokens-per-s")) > 0
    page.screenshot(path=screenshots / "playground.png", full_page=True)
    assert (screenshots / "playground.png").stat().st_size > 10_000


def test_regenerate_replaces_the_reply_with_the_same_greedy_text(page):
    before = last_reply(page).locator(".content").text_content()
    page.click("#regenerate")
    wait_finished(page)
    expect(page.locator("#messages li.assistant")).to_have_count(1)
    assert last_reply(page).get_attribute("data-state") == "done"
    assert last_reply(page).locator(".content").text_content() == before


def test_the_sampling_controls_reach_the_server(page, server):
    """temperature, top_p, max tokens and seed as typed: the same seeded request gives the same text."""
    page.click("#clear")
    set_sampling(page, "0.9", 12)
    page.fill("#top-p", "0.95")
    page.fill("#seed", "7")
    ask(page, QUESTION)
    wait_finished(page)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    sampled = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 12}
    same, other = (
        authorized(server)
        .post("/v1/chat/completions", json={"messages": messages, **sampled, "seed": seed})
        .json()
        for seed in (7, 8)
    )
    text = last_reply(page).locator(".content").text_content()
    assert text == same["choices"][0]["message"]["content"]
    assert text != other["choices"][0]["message"]["content"]  # so the seed did matter
    assert last_reply(page).get_attribute("data-completion-tokens") == str(same["usage"]["completion_tokens"])


def never_at_end_of_sequence(route) -> None:
    """The page's chat request with ignore_eos: the tiny random model's greedy reply may end at once
    on one backend and not on another, and a reply that has ended cannot be stopped."""
    body = {**json.loads(route.request.post_data), "ignore_eos": True}
    route.continue_(post_data=json.dumps(body))


def test_stop_ends_the_stream_and_frees_the_slot(page, server):
    page.click("#clear")
    cancelled_before, finished_before = metric(server, CANCELLED), metric(server, FINISHED)
    set_sampling(page, "0", LONG)
    page.route("**/v1/chat/completions", never_at_end_of_sequence)
    try:
        ask(page, QUESTION)
        page.wait_for_function(  # streaming, with some text to keep
            "() => { const r = [...document.querySelectorAll('#messages li.assistant')].at(-1);"
            " return r && r.dataset.state === 'streaming' && r.querySelector('.content').textContent.length > 0; }"
        )
        # The click event itself: Page.click first waits for two animation frames with the button
        # in one place, and a 2-core machine redrawing the stream under load may not give it those
        # within a minute (seen: "locator resolved to <button id=stop>" and nothing more).
        page.locator("#stop").dispatch_event("click")
        # Counted from the click, not from the request: how long a loaded browser takes to show the
        # first text and take the click is not the server's doing (CI once saw 2,000 calls before it).
        calls_at_click = metric(server, GENERATE_CALLS)
    finally:
        page.unroute("**/v1/chat/completions", never_at_end_of_sequence)
    # The server saw the client go: the request ends as cancelled, not at its length, and its slot
    # is free again (the events themselves, whenever they come, not a state a fast machine has left).
    assert wait_for(lambda: metric(server, CANCELLED) == cancelled_before + 1, timeout=60)
    assert metric(server, FINISHED) == finished_before
    assert wait_for(lambda: metric(server, "pathserve_active_slots") == 0, timeout=60)
    # The device loop's own count: freed a few generate calls after the click, not after the rest
    # of the reply's 7,500 (4 steps each).
    assert metric(server, GENERATE_CALLS) - calls_at_click < LONG / 4 / 8
    wait_finished(page)
    reply = last_reply(page)
    assert reply.get_attribute("data-state") == "stopped"
    expect(reply.locator(".stats .finish")).to_have_text("stopped")
    assert reply.locator(".content").text_content()  # the partial reply stays


def test_an_api_error_is_shown_as_a_readable_message(page):
    page.click("#clear")
    set_sampling(page, "5", MAX_TOKENS)  # the server allows 0..2
    ask(page, QUESTION)
    wait_finished(page)
    reply = last_reply(page)
    assert reply.get_attribute("data-state") == "error"
    expect(reply.locator(".error-text")).to_contain_text("Error 400 (bad request): temperature")
    set_sampling(page, "0", MAX_TOKENS)
    page.click("#regenerate")  # retries the failed reply with the mended setting
    wait_finished(page)
    assert last_reply(page).get_attribute("data-state") == "done"
    expect(page.locator("#messages li.assistant")).to_have_count(1)


def test_the_status_strip_shows_readiness_slots_and_queue(page):
    expect(page.locator("#status-ready")).to_have_text("ready")
    expect(page.locator("#status-slots")).to_have_text(f"slots 0/{SLOTS}")
    expect(page.locator("#status-queue")).to_have_text("queue 0")


def fill(client: httpx.Client, streams: contextlib.ExitStack, server: ServerProcess) -> None:
    """Take every slot (each in turn), then every queue place until the server answers 429; the
    streams are left unread and run until `streams` closes them (the server then cancels them)."""
    body = {"prompt": QUESTION, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    for admitted in range(1, SLOTS + 1):
        streams.enter_context(client.stream("POST", "/v1/completions", json=body))
        assert wait_for(lambda n=admitted: metric(server, "pathserve_active_slots") == n, timeout=60)
    for _ in range(QUEUE + 1):
        if streams.enter_context(client.stream("POST", "/v1/completions", json=body)).status_code == 429:
            return
    pytest.fail(f"the queue of {QUEUE} never filled")


def test_a_full_queue_shows_the_429_and_the_strip_counts_it(page, server):
    page.click("#clear")
    set_sampling(page, "0", MAX_TOKENS)
    with authorized(server) as client, contextlib.ExitStack() as streams:
        fill(client, streams, server)
        ask(page, QUESTION)
        wait_finished(page)
        error = last_reply(page).locator(".error-text")
        expect(error).to_contain_text("Error 429 (too many requests): the admission queue is full")
        expect(error).to_contain_text("retry in 1 s")  # the Retry-After header
        # The strip refreshes when a reply ends, so it shows the state that refused it.
        expect(page.locator("#status-ready")).to_have_text("not ready: admission queue full")
        expect(page.locator("#status-slots")).to_have_text(f"slots {SLOTS}/{SLOTS}")
        expect(page.locator("#status-queue")).to_have_text(f"queue {QUEUE}")
    # Closing the streams cancels them, queued ones included.
    idle = ("pathserve_active_slots", "jetstream_prefill_backlog_size")
    assert wait_for(lambda: all(metric(server, name) == 0 for name in idle), timeout=60)


def test_a_narrow_screen_fits_without_sideways_scrolling(browser, server, screenshots, requested):
    context = browser.new_context(viewport={"width": 360, "height": 740}, is_mobile=True)
    context.on("request", lambda request: requested.append(request.url))
    narrow = context.new_page()
    try:
        narrow.goto(server.url + "/")
        expect(narrow.locator("#send")).to_be_visible()
        expect(narrow.locator("#settings")).not_to_have_attribute("open", "")
        width = narrow.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        assert width[0] <= width[1], width
        narrow.screenshot(path=screenshots / "narrow.png")
    finally:
        context.close()


def test_the_page_requested_nothing_but_the_server(requested, server, page):
    assert page.evaluate("() => window.refused") == []  # nor tried to
    assert any(url.endswith("/static/playground.js") for url in requested), requested
    assert any(urlsplit(url).path == "/v1/chat/completions" for url in requested), requested
    hosts = {urlsplit(url).netloc for url in requested}
    assert hosts == {urlsplit(server.url).netloc}, hosts


def test_while_draining_a_send_shows_the_503_and_the_strip_says_so(page, server):
    """Last: SIGTERM with long requests in flight; the page's next send is refused with a 503."""
    page.click("#clear")
    set_sampling(page, "0", MAX_TOKENS)
    with authorized(server) as client, contextlib.ExitStack() as streams:
        fill(client, streams, server)
        server.signal()  # the drain waits for the requests in flight
        assert wait_for(lambda: httpx.get(server.url + "/readyz").status_code == 503, timeout=10)
        ask(page, QUESTION)
        wait_finished(page)
        expect(last_reply(page).locator(".error-text")).to_have_text(
            "Error 503 (unavailable): the server is shutting down"
        )
        expect(page.locator("#status-ready")).to_have_text("not ready: draining")
        assert metric(server, "pathserve_active_slots") == SLOTS  # the drain was under way all along
        server.signal()  # a second signal stops at once, rather than after the long requests
        server.proc.wait(60)

