"""The chat page: `GET /` and `GET /static/<name>`, files shipped inside the package.

The page holds no secrets, so it never needs the API key; the API calls it makes do. The files
are read once, when the app is made, into a table keyed by name: a request picks an entry of
that table and never names a path on disk. Every response carries headers that let the page
run only its own script and style, from this server (docs/serving.md, "The chat page").
"""

from __future__ import annotations

from importlib import resources

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}

# Only this origin's files; no inline script or style, no frames, no plugins, no form posts.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=(), payment=(), usb=()",
    "Cache-Control": "no-cache",  # revalidate, so a new version of the page shows at once
}


def static_files() -> dict[str, tuple[bytes, str]]:
    """name -> (content, media type) for every file in astrai/serve/static."""
    folder = resources.files("astrai.serve") / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in MEDIA_TYPES:
            files[entry.name] = (entry.read_bytes(), MEDIA_TYPES[suffix])
    return files


def page_response(content: bytes, media_type: str) -> Response:
    return Response(content, media_type=media_type, headers=SECURITY_HEADERS)


def page_routes() -> list[Route]:
    """`GET /` (the page) and `GET /static/<name>`; both public, as the page holds no secret."""
    files = static_files()

    async def index(request: Request) -> Response:
        return page_response(*files["index.html"])

    async def static(request: Request) -> Response:
        entry = files.get(request.path_params["name"])
        if entry is None:
            raise HTTPException(404, "Not Found")  # the app answers it like any unknown path
        return page_response(*entry)

    return [
        Route("/", index, methods=["GET"]),
        Route("/static/{name}", static, methods=["GET"]),
    ]
