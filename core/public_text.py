"""Text a tenant reads, without the server's file system paths.

Job events, job errors and error envelopes are built from messages the worker and libraries write, which often
name files ("model saved to /srv/trainserve/jobs/<id>/model", an OSError naming a checkpoint). A path under the
service's storage layout becomes its storage key (`jobs/<id>/model`, the name the API itself uses); any other
absolute path on a file system root becomes its last component.
"""

from __future__ import annotations

import re

# First components of absolute paths on the machines the service runs on (Linux, macOS, containers). API routes
# (/v1/..., /jobs/...) start with none of them, so they are left alone.
ROOTS = ("home", "root", "tmp", "var", "usr", "opt", "srv", "mnt", "media", "data", "work", "workspace", "app",
         "etc", "proc", "sys", "dev", "run", "private", "Users", "Volumes", "nix", "lib", "lib64", "bin", "sbin",
         "snap", "boot", "scratch", "nfs", "gpfs", "lustre", "shared", "cache")
# Storage keys (core.paths): what follows one of these segments is the object's key.
KEY_SEGMENTS = ("jobs", "datasets", "models", "files", "batches")
_PART = r"[^\s'\"`/:,;()\[\]{}<>|]+"
_PATH = re.compile(rf"(?<![\w.:/~%-])(?:/(?:{'|'.join(ROOTS)})(?:/{_PART})*/?|~(?:/{_PART})+)")
_KEY = re.compile(rf"/((?:{'|'.join(KEY_SEGMENTS)})/{_PART}(?:/{_PART})*)$")


def _shorten(match: re.Match[str]) -> str:
    path = match.group(0).rstrip("/")
    key = _KEY.search(path)
    if key is not None:
        return key.group(1)
    return path.rsplit("/", 1)[-1] or "<path>"


def public_text(text: str) -> str:
    """`text` with server paths replaced by storage keys or bare file names."""
    return _PATH.sub(_shorten, text) if "/" in text else text
