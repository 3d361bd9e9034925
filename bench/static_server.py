"""The strongest simple generation server a user would write: Hugging Face `generate` with static batching.

One thread takes up to `--max-batch` waiting requests (waiting at most `--max-wait-ms` after the first for more),
runs one left-padded `model.generate` over them, greedy, for the longest `max_tokens` among them, and streams each
row's tokens to its client as the batch produces them (a `transformers` streamer), ending a row's stream at its
own `max_tokens`. A request that arrives while a batch runs waits for the next batch: that is static batching,
the baseline `bench/serve.py` compares continuous batching with.

    POST /generate {"prompt": str, "max_tokens": int}  ->  text/event-stream of
        data: {"token": id} ... data: {"done": true, "text": str, "completion_tokens": n}

    python bench/static_server.py --model FOLDER --port 8100 [--max-batch 32] [--max-wait-ms 20] [--dtype fp32]

`--max-batch` defaults to the service's own row budget (TRAINSERVE_MAX_BATCH_SIZE's default), so both sides of
`bench/serve.py` decode at most as many rows at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from core.settings import Settings  # noqa: E402


class Body(BaseModel):
    prompt: str
    max_tokens: int = Field(ge=1, le=4096)


@dataclass
class Pending:
    """One request: its prompt, its own token budget and the queue its stream reads (None ends it)."""

    prompt: str
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)

    def send(self, item: dict | None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class RowStreamer(BaseStreamer):
    """Hands each generated column of the batch to its rows; a row past its own max_tokens gets nothing more."""

    def __init__(self, rows: list[Pending], decode) -> None:
        self.rows, self.decode, self.prompt_seen = rows, decode, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate's first put is the prompt itself
            self.prompt_seen = True
            return
        for row, token in zip(self.rows, value.reshape(-1).tolist(), strict=True):
            if len(row.tokens) < row.max_tokens:
                row.tokens.append(token)
                row.send({"token": token})
                if len(row.tokens) == row.max_tokens:
                    self.finish(row)

    def end(self) -> None:
        for row in self.rows:
            if len(row.tokens) < row.max_tokens:  # an eos ended the batch early
                self.finish(row)

    def finish(self, row: Pending) -> None:
        row.send({"done": True, "text": self.decode(row.tokens, skip_special_tokens=True),
                  "completion_tokens": len(row.tokens)})
        row.send(None)


class StaticBatcher:
    """The batching thread: collect, generate, stream; one batch at a time."""

    def __init__(self, folder: Path, max_batch: int, max_wait: float, dtype: torch.dtype) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.tokenizer.padding_side = "left"  # decoder-only models pad on the left for generation
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token  # any id: padded positions are masked out
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        self.max_batch, self.max_wait = max_batch, max_wait
        self.waiting: queue.Queue[Pending] = queue.Queue()
        self.batches = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def _collect(self) -> list[Pending]:
        batch = [self.waiting.get()]
        deadline = time.monotonic() + self.max_wait
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self.waiting.get(timeout=left))
            except queue.Empty:
                break
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._collect()
            inputs = self.tokenizer([row.prompt for row in batch], return_tensors="pt", padding=True)
            with torch.inference_mode():
                self.model.generate(**inputs, do_sample=False, max_new_tokens=max(r.max_tokens for r in batch),
                                    pad_token_id=self.tokenizer.pad_token_id,
                                    streamer=RowStreamer(batch, self.tokenizer.decode))
            self.batches += 1


def create_app(batcher: StaticBatcher) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "batches": batcher.batches}

    @app.post("/generate")
    async def generate(body: Body) -> StreamingResponse:
        row = Pending(body.prompt, body.max_tokens, asyncio.get_running_loop())
        batcher.waiting.put(row)

        async def events():
            while (item := await row.out.get()) is not None:
                yield f"data: {json.dumps(item)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-batch", type=int, default=Settings.model_fields["max_batch_size"].default,
                        help="requests per batch (default: the service's max_batch_size)")
    parser.add_argument("--max-wait-ms", type=float, default=20.0)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    batcher = StaticBatcher(args.model, args.max_batch, args.max_wait_ms / 1000, dtype)
    uvicorn.run(create_app(batcher), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
