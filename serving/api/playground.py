"""The web playground: `GET /` serves a chat page, `/static/*` its script and style sheet.

The page is plain HTML, CSS and JavaScript modules shipped in the package (`serving/api/static/`):
no build step, nothing fetched from another host. It holds no data, so it is served without the
API key (the gate guards only the API routes); it asks for the key when `/v1/models` answers 401
and sends it as a bearer token. It speaks to the server with relative URLs only, so it works
behind `kubectl port-forward` or a path prefix.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
# Only this server: a page that tried to reach another host (a CDN, fonts) would be refused.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; connect-src 'self'; img-src 'self' data:; style-src 'self'; "
    "script-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"}


def mount(app: FastAPI) -> None:
    """Add `GET /` (the page) and `/static` (its assets) to `app`; neither is in the OpenAPI schema."""

    @app.get("/", include_in_schema=False)
    def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
