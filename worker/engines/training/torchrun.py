"""torchrun as a worker starts it: the process ends (SIGTERM, which torchrun passes on to its ranks) when the worker
that started it dies, so a lost worker leaves no ranks training on. Kept light: it imports nothing of the engines."""

from __future__ import annotations

import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """Ask Linux to send `sig` to this process when the process (thread) that started it ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))


def main(argv: list[str]) -> None:
    """Run torchrun with `argv`, ended with its parent."""
    from torch.distributed.run import main as run_torchrun

    die_with_parent(signal.SIGTERM)
    run_torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
