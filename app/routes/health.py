"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.deps import SessionDep

router = APIRouter(tags=["health"])


@router.get("/health")
def health(session: SessionDep) -> JSONResponse:
    """200 when the database answers, 503 otherwise."""
    try:
        session.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any database failure means not ready
        return JSONResponse(status_code=503, content={"status": "unavailable", "database": "unreachable"})
    return JSONResponse(content={"status": "ok", "database": "ok"})
