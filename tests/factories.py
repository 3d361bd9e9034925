"""Helpers that create rows through the API, the way clients do."""

from __future__ import annotations

from typing import Any

POSITIVE = ["a wonderful , moving film", "great acting and a lovely story", "i loved every minute",
            "brilliant , funny and warm", "a delightful surprise", "superb and touching"]
NEGATIVE = ["a dull , lifeless mess", "boring and far too long", "i hated every minute",
            "awful script and wooden acting", "a tedious disappointment", "terrible and pointless"]


def tsv_bytes(rows: list[tuple[str, Any]], header: tuple[str, str] = ("sentence", "label")) -> bytes:
    """A GLUE-style TSV file."""
    lines = ["\t".join(header)] + [f"{text}\t{label}" for text, label in rows]
    return ("\n".join(lines) + "\n").encode()


def sentiment_rows(repeat: int = 1) -> list[tuple[str, int]]:
    """A tiny, trivially separable sentiment dataset."""
    rows = [(t, 1) for t in POSITIVE] + [(t, 0) for t in NEGATIVE]
    return rows * repeat


def upload(client: Any, content: bytes, filename: str = "train.tsv", name: str | None = None) -> Any:
    """POST /datasets with a file."""
    data = {"name": name} if name is not None else {}
    return client.post("/datasets", files={"file": (filename, content)}, data=data)


def job_body(train_id: str, eval_id: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A valid POST /jobs body on the built-in model."""
    body: dict[str, Any] = {"task": "text-classification", "base_model": "minilm-l6", "train_dataset": train_id,
                            "text_column": "sentence", "label_column": "label",
                            "hyperparameters": {"epochs": 1, "batch_size": 4}}
    if eval_id:
        body["eval_dataset"] = eval_id
    body.update(overrides)
    return body
