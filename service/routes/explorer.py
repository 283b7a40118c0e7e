"""The model explorer: `GET /` serves a static page (plain JavaScript and SVG, shipped in the package under
`static/`) that looks inside the served models through the public REST API alone.

The page and its assets hold no data, so they are served without an API key (the auth middleware guards
`/v1` only); the page sends the key the user enters with every API call. Every URL in the page is relative
to the page, so it works behind a reverse proxy that serves the app under a path prefix."""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from latentlm.service.errors import APIError

router = APIRouter(tags=["explorer"], include_in_schema=False)

PAGE = "explorer.html"
# asset name -> media type; only these files are ever served
ASSETS = {"explorer.js": "text/javascript; charset=utf-8", "explorer.css": "text/css; charset=utf-8"}


@cache
def _read(name: str) -> tuple[bytes, str]:
    """The bytes of a packaged static file and their ETag (read once per process)."""
    data = (resources.files("latentlm.service") / "static" / name).read_bytes()
    return data, '"' + hashlib.sha256(data).hexdigest()[:32] + '"'


def _serve(request: Request, name: str, media_type: str) -> Response:
    data, etag = _read(name)
    headers = {"ETag": etag, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(data, media_type=media_type, headers=headers)


@router.get("/")
async def page(request: Request) -> Response:
    """The explorer page (HTML)."""
    return _serve(request, PAGE, "text/html; charset=utf-8")


@router.get("/explorer/{name}")
async def asset(name: str, request: Request) -> Response:
    """One of the page's static assets (404 naming `name` for anything else)."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise APIError(404, f"name: no explorer asset {name!r} (assets: {', '.join(sorted(ASSETS))})",
                       param="name", code="not_found")
    return _serve(request, name, media_type)
