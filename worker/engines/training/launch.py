"""A training run on several devices: torchrun starts one process per device; rank 0 reports back to the caller.

The caller (a worker's training task) calls train_on_devices() as it would train(): it writes the frozen
config, listens on a Unix socket in a private folder and starts `python -m torch.distributed.run` in a new
session. Each rank runs this module's main(): the one training loop with its Dist. Rank 0 turns every
callback into a typed core.protocol.RankMessage on the socket (and waits for the answer to should_stop), so
progress, cancellation and preemption go through the caller's callbacks exactly as in one process; the
launch ends with a `result` or `error` message. A caller that dies closes the socket, rank 0 fails on its
next message, and torchrun stops the other ranks; torchrun and the ranks also die with their parent (Linux).

On several nodes (`Rendezvous`: worker.jobs.gang gathers them) every node's worker starts torchrun with its node
rank and the head's address; node 0 is the head's, so global rank 0, which reports, runs beside the caller.
join_run() runs another node's ranks: nothing reports there, and the caller may end them at any time.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from core.protocol import (
    RANK_MESSAGE,
    ErrorCode,
    RankBest,
    RankCheckpoint,
    RankError,
    RankEval,
    RankEvent,
    RankLog,
    RankMessage,
    RankResult,
    RankShouldStop,
    RankStart,
    RankStopReason,
)
from worker.engines.training import torchrun
from worker.engines.training.distributed import Dist, leave
from worker.engines.training.kinds import engine_ref, entry_of, resolve_engine
from worker.engines.training.loop import Recipe, RunConfig, TrainCallbacks, TrainResult, run
from worker.engines.training.torchrun import die_with_parent

log = logging.getLogger(__name__)

_ADDRESS, _AUTHKEY = "TRAINSERVE_RANK0_ADDRESS", "TRAINSERVE_RANK0_AUTHKEY"
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the `worker` package, for the ranks' imports


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's ranks meet those of the other nodes: torchrun's static rendezvous, served by node 0."""

    node_rank: int  # 0: the head, whose local rank 0 is the run's rank 0
    nodes: int
    address: str  # node 0's address, reachable from every node
    port: int  # the TCP port node 0 serves the rendezvous store on
    timeout_s: float  # how long a node waits for the others to arrive

    def torchrun_args(self) -> list[str]:
        """torchrun's arguments for this node (the static rendezvous: node ranks fixed by the caller)."""
        return [f"--nnodes={self.nodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.address}",
                f"--master-port={self.port}", "--rdzv-backend=static",
                f"--rdzv-conf=timeout={math.ceil(self.timeout_s)}"]


class LaunchFailed(RuntimeError):
    """A rank failed (with the error's own code when rank 0 could send it), or the launch died without a word."""

    def __init__(self, message: str, code: str = ErrorCode.TRAINING_ERROR) -> None:
        super().__init__(message)
        self.code = code


def train_on_devices(config: RunConfig, callbacks: TrainCallbacks | None = None,
                     rendezvous: Rendezvous | None = None) -> TrainResult:
    """Run (or resume) `config` on config.devices processes under torchrun, as node 0 of `rendezvous` when the run
    spans several nodes; returns rank 0's result. On several nodes a launch that ends without a word from rank 0
    fails with code node_lost: a peer's loss is what usually ends it so."""
    callbacks = callbacks or TrainCallbacks()
    silent = ErrorCode.TRAINING_ERROR if rendezvous is None else ErrorCode.NODE_LOST
    with tempfile.TemporaryDirectory(prefix="trainserve-ranks-") as folder:  # mode 0700: only this user
        config_file, output = _write_config(config, Path(folder))
        address, authkey = str(Path(folder) / "rank0.sock"), os.urandom(32)
        with Listener(address, family="AF_UNIX", authkey=authkey) as listener, output.open("wb") as sink:
            process = _start(config, config_file, rendezvous, sink, {_ADDRESS: address, _AUTHKEY: authkey.hex()})
            try:
                with _accept(listener, process, address, authkey, output, silent) as connection:
                    return _serve(connection, process, callbacks, output, silent)
            finally:
                _end(process)


def join_run(config: RunConfig, rendezvous: Rendezvous, keep_going: Callable[[], bool]) -> None:
    """Run node `rendezvous.node_rank` (not 0) of a run on several nodes until its ranks end; ends them early once
    keep_going() is False. LaunchFailed when they fail (a lost head or peer included)."""
    if rendezvous.node_rank == 0:
        raise ValueError("node 0 is the head's: train_on_devices runs it")
    with tempfile.TemporaryDirectory(prefix="trainserve-ranks-") as folder:
        config_file, output = _write_config(config, Path(folder))
        with output.open("wb") as sink:
            process = _start(config, config_file, rendezvous, sink, {})
            try:
                while process.poll() is None:
                    if not keep_going():
                        return
                    try:
                        process.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        continue
                if process.returncode != 0:
                    raise LaunchFailed(f"node {rendezvous.node_rank} exited with {process.returncode}: "
                                       f"{_tail(output)}", code=ErrorCode.NODE_LOST)
            finally:
                _end(process)


def _write_config(config: RunConfig, folder: Path) -> tuple[Path, Path]:
    """The frozen config the ranks read, and the file the launch's output goes to."""
    config_file = folder / "config.json"
    config_file.write_bytes(TypeAdapter(type(config)).dump_json(config))
    return config_file, folder / "launch.log"


def _start(config: RunConfig, config_file: Path, rendezvous: Rendezvous | None, sink: Any,
           extra_env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start torchrun for this node's config.devices ranks (ended with the caller: training.torchrun)."""
    engine = engine_ref(entry_of(config))  # `module:attribute` of its EngineKind: each rank resolves it by this alone
    topology = ["--standalone", "--nnodes=1"] if rendezvous is None else rendezvous.torchrun_args()
    command = [sys.executable, "-m", torchrun.__name__, *topology, f"--nproc-per-node={config.devices}",
               "--max-restarts=0", "-m", __name__, engine, str(config_file)]
    # A new session: a signal meant for the worker (Ctrl+C, a warm shutdown) reaches the ranks only
    # through should_stop, so they checkpoint instead of dying mid-step.
    return subprocess.Popen(command, env=_rank_env(config, extra_env), stdout=sink, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _rank_env(config: RunConfig, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
    if config.device.strip().lower() == "cpu":
        # N processes on one CPU: each gets its share of the cores instead of all of them fighting.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.devices)))
    return env


def _accept(listener: Listener, process: subprocess.Popen[bytes], address: str, authkey: bytes,
            output: Path, silent: str) -> Connection:
    """Wait for rank 0 to connect, or fail as soon as the launch exits without it."""
    accepted: list[Connection] = []
    waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), name="rank0-accept", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.5)
        if waiter.is_alive() and process.poll() is not None:
            Client(address, family="AF_UNIX", authkey=authkey).close()  # wakes the blocked accept()
            waiter.join()
            raise LaunchFailed(f"the launch exited with {process.returncode} before rank 0 started: {_tail(output)}",
                               code=silent)
    if not accepted:
        raise LaunchFailed(f"rank 0 could not connect: {_tail(output)}", code=silent)
    return accepted[0]


def _serve(connection: Connection, process: subprocess.Popen[bytes], callbacks: TrainCallbacks,
           output: Path, silent: str) -> TrainResult:
    """Hand rank 0's messages to the callbacks until its result (or its error) arrives."""
    while True:
        if not connection.poll(1.0):
            if process.poll() is not None:
                raise LaunchFailed(f"the launch exited with {process.returncode} without a result: {_tail(output)}",
                                   code=silent)
            continue
        try:
            message = RANK_MESSAGE.validate_json(connection.recv_bytes())
        except EOFError:
            process.wait(timeout=60)
            raise LaunchFailed(f"rank 0 closed its channel without a result: {_tail(output)}", code=silent) from None
        if isinstance(message, RankResult):
            process.wait(timeout=120)  # the other ranks end right after their last step
            return TrainResult(message.status, message.step, message.total_steps, message.metrics,
                               Path(message.path) if message.path else None, message.manifest,
                               stop_reason=message.stop_reason, best=message.best)
        if isinstance(message, RankError):
            raise LaunchFailed(message.message, code=message.code)
        _answer(connection, message, callbacks)


def _answer(connection: Connection, message: RankMessage, callbacks: TrainCallbacks) -> None:
    """Hand one callback message to the caller's callbacks (answering the questions on the channel)."""
    match message:
        case RankShouldStop():
            connection.send_bytes(b"1" if callbacks.should_stop() else b"0")
        case RankStopReason():
            connection.send_bytes((callbacks.stop_reason() or "").encode())
        case RankBest():
            callbacks.on_best(message.step, message.best)
        case RankStart():
            callbacks.on_start(message.info)
        case RankLog():
            callbacks.on_log(message.step, message.epoch, message.metrics)
        case RankEval():
            callbacks.on_eval(message.step, message.metrics)
        case RankCheckpoint():
            callbacks.on_checkpoint(message.step, Path(message.path))
        case RankEvent():
            callbacks.on_event(message.event, message.message)


def _end(process: subprocess.Popen[bytes]) -> None:
    """Stop whatever of the launch is still running (torchrun passes SIGTERM on to its ranks)."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(output: Path, limit: int = 2000) -> str:
    text = output.read_bytes()[-limit:].decode(errors="replace").strip()
    return text or "(no output)"


class RankZeroCallbacks(TrainCallbacks):
    """Rank 0's callbacks: each one a message to the launching process, should_stop a question and its answer."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def send(self, message: RankMessage) -> None:
        """Send one message (typed, so a message the caller cannot read fails here)."""
        self.connection.send_bytes(RANK_MESSAGE.dump_json(message))

    def on_start(self, info: dict[str, Any]) -> None:
        self.send(RankStart(info=info))

    def on_log(self, step: int, epoch: float, metrics: dict[str, float]) -> None:
        self.send(RankLog(step=step, epoch=epoch, metrics=metrics))

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.send(RankEval(step=step, metrics=metrics))

    def on_checkpoint(self, step: int, path: Path) -> None:
        self.send(RankCheckpoint(step=step, path=str(path)))

    def on_event(self, kind: str, message: str) -> None:
        self.send(RankEvent(event=kind, message=message))

    def on_best(self, step: int, best: dict[str, Any]) -> None:
        self.send(RankBest(step=step, best=best))

    def should_stop(self) -> bool:
        self.send(RankShouldStop())
        return self.connection.recv_bytes() == b"1"

    def stop_reason(self) -> str | None:
        self.send(RankStopReason())
        return self.connection.recv_bytes().decode() or None


def main(argv: list[str]) -> int:
    """One rank: read the config, run the loop as rank RANK of WORLD_SIZE; rank 0 reports to the launcher."""
    ref, config_file = argv
    die_with_parent(signal.SIGKILL)  # torchrun SIGKILLed (its node lost): nothing may keep training on without it
    engine = resolve_engine(ref)  # a plugin kind's engine too: the reference names its module
    config = TypeAdapter(engine.config).validate_json(Path(config_file).read_bytes())
    dist = Dist.from_env()
    if dist.world_size != config.nodes * config.devices:
        raise ValueError(f"launched with {dist.world_size} processes for a run on {config.nodes} x {config.devices} "
                         "devices")
    reporter: RankZeroCallbacks | None = None
    if dist.is_main:
        reporter = RankZeroCallbacks(Client(os.environ[_ADDRESS], family="AF_UNIX",
                                            authkey=bytes.fromhex(os.environ[_AUTHKEY])))
    recipe: Recipe = engine.task(config)
    try:
        result = run(config, recipe, reporter or TrainCallbacks(), dist)
    except Exception as exc:
        if reporter is not None:
            reporter.send(RankError(code=str(getattr(exc, "code", ErrorCode.TRAINING_ERROR)),
                                    message=f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        leave()
    if reporter is not None:
        reporter.send(RankResult(status=result.status, step=result.global_step, total_steps=result.total_steps,
                                 metrics=result.metrics, manifest=result.manifest, stop_reason=result.stop_reason,
                                 best=result.best, path=str(result.model_dir) if result.model_dir else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
