"""Does `trainserve worker --device X` see only X? Each device is checked in a fresh process, pinned by the CLI.

Usage: python bench/device_pin_check.py [--json PATH]   (cuda:N for every GPU nvidia-smi lists, and cpu)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child: the CLI's own pinning first (as `trainserve worker --device` does), then torch and the
# worker's device plan, exactly in that order.
CHILD = """
import json, os, sys
from trainserve.cli import pin_device
pin_device(sys.argv[1])
import torch
from worker.engines.device import resolve_device
count = torch.cuda.device_count()
seen = [torch.cuda.get_device_properties(i) for i in range(count)]
plan = resolve_device(os.environ["TRAINSERVE_WORKER_DEVICE"], "auto", training=True)
print(json.dumps({"requested": sys.argv[1], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "visible": count, "uuids": [str(getattr(p, "uuid", "")) for p in seen],
                  "names": [p.name for p in seen], "plan_device": plan.device, "plan_precision": plan.precision}))
"""


def gpus() -> list[dict[str, str]]:
    """index and uuid of each GPU nvidia-smi lists (none without a driver)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [dict(zip(("index", "uuid"), (f.strip() for f in line.split(",")), strict=True))
            for line in out.splitlines() if line.strip()]


def check(device: str, expected_uuid: str | None) -> dict:
    """Run the child for `device`; ok when it sees exactly that GPU (or, for cpu, none) and plans on it."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", CHILD, device], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        return {"requested": device, "ok": False, "error": out.stderr[-2000:]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if device == "cpu":
        result["ok"] = result["visible"] == 0 and result["plan_device"] == "cpu"
    else:
        # nvidia-smi's uuid is "GPU-xxxxxxxx-..."; torch's is the bare uuid.
        same = expected_uuid is None or expected_uuid.removeprefix("GPU-") in result["uuids"][0]
        result["ok"] = result["visible"] == 1 and result["plan_device"] == "cuda:0" and same
    return result


def main() -> None:
    """Check every GPU and the CPU; print one line each; exit 1 if any check failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    listed = gpus()
    results = [check(f"cuda:{g['index']}", g["uuid"]) for g in listed] + [check("cpu", None)]
    for r in results:
        print(f"worker --device {r['requested']:<7} CUDA_VISIBLE_DEVICES={r.get('cuda_visible_devices')!s:<4} "
              f"sees {r.get('visible', '?')} GPU(s) {r.get('names', '')}, plans {r.get('plan_device', '?')}/"
              f"{r.get('plan_precision', '?')}: {'ok' if r['ok'] else 'FAILED ' + r.get('error', '')}")
    if not listed:
        print("no GPU listed by nvidia-smi: only the cpu pinning was checked")
    if args.json:
        args.json.write_text(json.dumps({"gpus": listed, "results": results}, indent=1))
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
