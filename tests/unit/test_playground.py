"""The playground's files as the HTTP app serves them (no engine, no browser: tests/browser/ drives
the page itself): served without the key while the API wants one, before the model is ready, only
relative URLs, nothing from another host, not in the OpenAPI schema."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from fastapi.testclient import TestClient

from serving.api.app import create_app
from serving.api.playground import STATIC
from serving.api.state import ServerState
from serving.config import ServingConfig

ASSET_TYPES = {".js": "text/javascript", ".css": "text/css"}


class _Links(HTMLParser):
    """The src and href attributes of a page."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


@pytest.fixture(scope="module")
def client() -> TestClient:
    # A key is set and the model is not loaded: the page must still be served.
    return TestClient(create_app(ServerState(config=ServingConfig().server, api_key="k")))


def test_the_page_is_served_without_the_key_before_the_model_is_ready(client):
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/v1/models").status_code == 401  # the API itself still wants the key


def test_every_asset_of_the_page_is_relative_and_served(client):
    links = _Links()
    links.feed(client.get("/").text)
    assets = [url for url in links.urls if not url.startswith("data:")]
    assert "static/playground.js" in assets and "static/playground.css" in assets
    for url in assets:
        assert not url.startswith(("/", "http:", "https:")), url
        response = client.get(f"/{url}")
        assert response.status_code == 200, url
        expected = ASSET_TYPES[url[url.rindex(".") :]]
        assert response.headers["content-type"].startswith(expected), (url, response.headers)
    assert client.get("/static/no-such-file.js").status_code == 404


def test_the_scripts_call_relative_urls_and_name_no_other_host():
    sources = {path.name: path.read_text() for path in STATIC.iterdir()}
    assert {"index.html", "playground.js", "api.js", "status.js", "playground.css"} <= set(sources)
    for name, text in sources.items():
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name
    scripts = "".join(text for name, text in sources.items() if name.endswith(".js"))
    called = re.findall(r"""fetch\(\s*["'`]([^"'`]+)""", scripts)
    imported = re.findall(r"""from\s+["']([^"']+)["']""", scripts)
    assert set(called) == {"readyz", "metrics"}  # the API's own calls go through call(path) below
    assert set(re.findall(r"""call\(\s*["']([^"']+)""", scripts)) == {"v1/models", "v1/chat/completions"}
    assert all(url.startswith("./") for url in imported), imported


def test_the_page_is_not_part_of_the_api_schema(client):
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and not any(path.startswith("/static") for path in paths)
