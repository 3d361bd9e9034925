"""Chat with a served model in the terminal: each reply streams in token by token (/v1/chat/completions)."""

from __future__ import annotations

from typing import Any, TextIO

from rich.console import Console

from trainserve.client.api import Api, loads
from trainserve.client.text import plain, visible

EXIT_WORDS = {"/exit", "/quit"}


def stream_reply(api: Api, body: dict[str, Any], write: Any) -> str:
    """Send one chat request with stream: true; write each piece of text as it comes and return the whole reply."""
    pieces: list[str] = []
    for _, data, _ in api.events("POST", "/v1/chat/completions", json={**body, "stream": True}):
        if data == "[DONE]":
            break
        chunk = loads(data)
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") or ""
            if text:
                pieces.append(text)
                write(text)
    return "".join(pieces)


def chat(api: Api, console: Console, stdin: TextIO, *, model: str, system: str | None, max_tokens: int | None,
         temperature: float) -> int:
    """Read a user turn per line until EOF or /exit; the whole conversation goes with each turn (max_tokens None:
    the server's default)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = stdin.isatty()
    if interactive:
        console.print(f"[dim]chatting with {plain(model)}; /exit or Ctrl-D to leave[/]")
    while True:
        if interactive:
            console.print("[bold green]you>[/] ", end="")
        line = stdin.readline()
        if not line or line.strip() in EXIT_WORDS:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        console.print(f"[bold cyan]{plain(model)}>[/] ", end="")
        limit = {} if max_tokens is None else {"max_tokens": max_tokens}  # --max-tokens: errors name max_tokens
        reply = stream_reply(api, {"model": model, "messages": messages, **limit, "temperature": temperature},
                             lambda text: console.print(visible(text), end="", markup=False, highlight=False,
                                                         emoji=False, soft_wrap=True))
        console.print()
        messages.append({"role": "assistant", "content": reply})
