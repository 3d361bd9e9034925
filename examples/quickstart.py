"""The README's quickstart: upload a chat file, fine-tune a LoRA adapter through OpenAI's fine-tuning API, chat.

    .venv/bin/python examples/quickstart.py [--model smollm2-135m] [--url http://127.0.0.1:8000]
                                            [--key-file var/admin.key] [--data examples/data/chat_aye.jsonl]

Uses only the official `openai` client. --model is any base_model trainserve knows: here a folder under
<home>/models (var/models/smollm2-135m with `make run`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from openai import OpenAI


def main() -> None:
    """Run the quickstart against a running trainserve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key-file", type=Path, default=Path("var/admin.key"))
    parser.add_argument("--data", type=Path, default=Path("examples/data/chat_aye.jsonl"))
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.key_file.read_text().strip())
    training = client.files.create(file=args.data.open("rb"), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=args.model, training_file=training.id, suffix="aye",
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": args.epochs, "batch_size": 4, "learning_rate_multiplier": 4}}},   # lr 1.2e-3 for LoRA
        extra_body={"adapter": {"r": 8}})                      # LoRA: trainserve's own option, as an extra field
    print(f"job {job.id}: watch it at {args.url}/ (paste the key from {args.key_file})")
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        print(f"  {job.status}", end="\r", flush=True)
        time.sleep(5)
    print(f"job {job.id}: {job.status}", job.error or "")
    if job.status != "succeeded":
        raise SystemExit(1)
    reply = client.chat.completions.create(
        model=job.fine_tuned_model, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "You are a cheerful ship's captain."},
                  {"role": "user", "content": "What colour is grass?"}])
    print(reply.choices[0].message.content)


if __name__ == "__main__":
    main()
