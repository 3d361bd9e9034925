"""The web dashboard: static files shipped in the package (app/dashboard), served at / and /ui/."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboard"
# The page is small and changes with the server: browsers revalidate it rather than run a stale copy.
NO_CACHE = {"Cache-Control": "no-cache"}

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    """The dashboard's single page (it asks for an API key and calls the API from the browser)."""
    return FileResponse(DASHBOARD_DIR / "index.html", headers=NO_CACHE)


def mount_dashboard(app: FastAPI) -> None:
    """Serve the page at / and its scripts, styles and vendored chart library under /ui/."""
    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=DASHBOARD_DIR), name="ui")
