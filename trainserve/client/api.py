"""A small HTTP client for the service's REST routes: the error envelope becomes one readable exception."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from trainserve.client.config import ClientConfig


class ApiError(Exception):
    """The service answered with an error envelope (or could not be reached: status 0)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        self.status, self.code, self.field = status, code, field
        where = f" (field {field})" if field else ""
        super().__init__(f"{message}{where} [{status} {code}]" if status else message)


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        raise ApiError(response.status_code, str(error.get("code")), str(error.get("message")), error.get("field"))
    except (ValueError, KeyError, TypeError):
        raise ApiError(response.status_code, "http_error", response.text[:200] or response.reason_phrase) from None


class Api:
    """The service at `config.url`, called with `config.api_key`."""

    def __init__(self, config: ClientConfig, *, timeout: float = 30.0, transport: httpx.BaseTransport | None = None):
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.http = httpx.Client(base_url=config.url, headers=headers, timeout=timeout, transport=transport)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; its JSON body, or ApiError."""
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"cannot reach {self.http.base_url}: {exc}") from exc
        _raise_for(response)
        return response.json() if response.content else None

    def events(self, method: str, path: str, **kwargs: Any) -> Iterator[tuple[str, str, str | None]]:
        """Server-sent events as (event, data, id); a read timeout of None, so idle feeds do not break."""
        try:
            with self.http.stream(method, path, timeout=httpx.Timeout(30.0, read=None), **kwargs) as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                event, data, event_id = "message", [], None
                for line in response.iter_lines():
                    if not line:
                        if data:
                            yield event, "\n".join(data), event_id
                        event, data = "message", []
                    elif line.startswith("data:"):
                        data.append(line[5:].removeprefix(" "))
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("id:"):
                        event_id = line[3:].strip()
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"lost the stream from {self.http.base_url}: {exc}") from exc

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()


def loads(data: str) -> Any:
    """An event's JSON data."""
    return json.loads(data)
