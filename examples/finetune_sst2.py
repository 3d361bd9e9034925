"""The README walkthrough as a script: fine-tune minilm-l6 on SST-2 over HTTP and classify with the result.

Start the service first (`make run`, or `trainserve up --home DIR`), then:

    python examples/finetune_sst2.py                     # http://127.0.0.1:8000, key from ./var/admin.key
    python examples/finetune_sst2.py --url http://127.0.0.1:8001 --key-file /tmp/other/admin.key
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key-file", type=Path, default=Path("var/admin.key"))
    parser.add_argument("--train", type=Path, default=DATA / "sst2_train_4k.tsv")
    parser.add_argument("--dev", type=Path, default=DATA / "sst2_dev.tsv")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.key_file.read_text().strip()}"}
    with httpx.Client(base_url=args.url, headers=headers, timeout=60) as api:
        train = api.post("/datasets", files={"file": (args.train.name, args.train.read_bytes())}).json()
        dev = api.post("/datasets", files={"file": (args.dev.name, args.dev.read_bytes())}).json()
        print(f"uploaded {train['rows']} training rows ({train['id']}) and {dev['rows']} dev rows ({dev['id']})")
        response = api.post("/jobs", json={
            "task": "text-classification", "base_model": "minilm-l6", "train_dataset": train["id"],
            "eval_dataset": dev["id"], "text_column": "sentence", "label_column": "label",
            "hyperparameters": {"epochs": 1, "batch_size": 32, "learning_rate": 1e-4, "max_length": 64,
                                "eval_steps": 50}})
        response.raise_for_status()
        job = response.json()
        print(f"job {job['id']} {job['status']}")
        started = time.monotonic()
        while job["status"] in ("queued", "running"):
            time.sleep(5)
            job = api.get(f"/jobs/{job['id']}").json()
            progress, metrics = job["progress"], job["metrics"]
            print(f"{time.monotonic() - started:6.0f}s {job['status']:<9} step {progress['step']}/"
                  f"{progress['total_steps']} ({progress['fraction']:.0%}) eta {job['eta_seconds']} s "
                  f"loss {metrics.get('train_loss', float('nan')):.4f} "
                  f"samples/s {metrics.get('samples_per_second', float('nan')):.1f}", flush=True)
        print(f"job {job['status']}: {job['metrics'] if job['status'] == 'succeeded' else job['error']}")
        if job["status"] != "succeeded":
            raise SystemExit(1)
        print(f"SST-2 dev accuracy {job['metrics']['eval_accuracy']:.4f}, F1 {job['metrics']['eval_f1']:.4f}")
        texts = ["a gorgeous , witty , seductive movie .", "the plot is a tedious mess ."]
        result = api.post("/classify", json={"model": job["id"], "texts": texts}).json()
        for text, prediction in zip(texts, result["predictions"], strict=True):
            print(f"{prediction['label']} ({prediction['score']:.3f})  {text}")


if __name__ == "__main__":
    main()
