"""The one place that decides device, precision, autocast and gradient scaling."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from core.precision import auto_precision

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# bf16 autocast adds casts around every matmul, so it pays only when a training step is clearly faster.
# CPUs with AVX512-BF16/AMX run bf16 matmuls 2-6x as fast as fp32, others 30x slower (emulated); a whole
# MiniLM step gains less than its matmuls (casts, the optimizer and the embedding update stay fp32), so a
# clear margin is required.
CPU_BF16_MIN_SPEEDUP = 1.5
# Generation casts the weights themselves (no autocast, half the bytes to stream per step) and its decode
# step is almost all packed matmuls, so what the calibration times is what a step does: a smaller margin.
CPU_BF16_DECODE_MIN_SPEEDUP = 1.3
_CALIBRATION_SHAPE = (256, 384, 1536)  # (tokens, width, outputs): a small BERT layer's sizes
# A 16-row decode step of GPT-2 small: rows, width, the MLP's 4x width, and an LM head large enough
# (96 MiB in fp32) not to fit in a cache, as the real 50,257-row one does not.
_DECODE_CALIBRATION_SHAPE = (16, 768, 3072, 32768)
_cpu_bf16_calibration: dict[str, bool] = {}  # per process and workload: the answer never changes while it runs
WORKLOADS = ("training", "generation")


@dataclass(frozen=True)
class DevicePlan:
    """Where a model runs and in which precision; built only by resolve_device()."""

    device: str
    precision: str
    autocast_dtype: torch.dtype | None
    use_grad_scaler: bool

    @property
    def device_type(self) -> str:
        """The torch device type ("cpu", "cuda") that autocast and GradScaler expect."""
        return torch.device(self.device).type

    @property
    def is_cuda(self) -> bool:
        """True when the plan places work on a CUDA device."""
        return self.device_type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast context for forward passes, or a no-op context for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self, *, sharded: bool = False) -> torch.amp.GradScaler:
        """A GradScaler that is active only for fp16 on CUDA (a pass-through otherwise); `sharded` for weights split
        over ranks (FSDP), whose scaler finds an inf or NaN in any rank's shard and all ranks skip the step."""
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # multi-device runs only

            return ShardedGradScaler(self.device_type, enabled=self.use_grad_scaler)
        return torch.amp.GradScaler(self.device_type, enabled=self.use_grad_scaler)

    @property
    def backend(self) -> str:
        """The torch.distributed backend for processes on this kind of device: NCCL on GPUs, gloo on CPUs."""
        return "nccl" if self.is_cuda else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """The device of one process of a multi-device run: cuda:<local rank> on a GPU worker, else the CPU.

    A worker owning N GPUs sees them (through CUDA_VISIBLE_DEVICES) as cuda:0..N-1, one per local rank.
    """
    name = device.strip().lower()
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return f"cuda:{local_rank}"


def resolve_device(device: str = "auto", precision: str = "auto", *, training: bool = False,
                   generation: bool = False) -> DevicePlan:
    """Resolve "auto"/"cpu"/"cuda[:N]" and "auto"/"fp32"/"fp16"/"bf16" into a DevicePlan.

    On a CPU, "auto" is fp32, except where a one-off calibration shows bf16 clearly faster: for training
    (fp32 master weights, bf16 autocast) and for generation (bf16 weights). Classification keeps fp32.
    """
    resolved = _resolve_device_name(device.strip().lower())
    is_cuda = resolved.startswith("cuda")
    precision = precision.strip().lower()
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        workload = "training" if training else "generation" if generation else None
        precision = auto_precision(
            is_cuda=is_cuda, bf16_supported=is_cuda and bf16_supported(resolved),
            cpu_bf16_faster=not is_cuda and workload is not None and cpu_bf16_faster(workload=workload))
    elif precision == "bf16" and is_cuda and not bf16_supported(resolved):
        raise ValueError(f"precision 'bf16' is not supported on {resolved}; use 'fp16' or 'fp32'")
    # fp16/bf16 on CPU means CPU autocast: allowed so tiny tests can exercise the mixed-precision
    # path, but slow on most CPUs. Loss scaling is only needed for fp16's narrow range on CUDA.
    return DevicePlan(
        device=resolved,
        precision=precision,
        autocast_dtype=_DTYPES[precision],
        use_grad_scaler=is_cuda and precision == "fp16",
    )


def cpu_bf16_faster(timings: Callable[[], tuple[float, float]] | None = None, *,
                    workload: str = "training") -> bool:
    """True when bf16 runs a workload's step clearly faster than fp32 here (cached per process and workload).

    "training" times a small training step under bf16 autocast (CPU_BF16_MIN_SPEEDUP), "generation" a decode
    step over packed bf16 weights (CPU_BF16_DECODE_MIN_SPEEDUP). `timings` returns (fp32 seconds, bf16
    seconds); tests pass a fake one, which is neither cached nor cached from.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}")
    if timings is not None:
        fp32, bf16 = timings()
        margin = CPU_BF16_MIN_SPEEDUP if workload == "training" else CPU_BF16_DECODE_MIN_SPEEDUP
        return fp32 >= margin * bf16
    if workload not in _cpu_bf16_calibration:
        timer = _time_cpu_matmuls if workload == "training" else _time_cpu_decode
        _cpu_bf16_calibration[workload] = cpu_bf16_faster(timer, workload=workload)
    return _cpu_bf16_calibration[workload]


def _time_cpu_matmuls(rounds: int = 6) -> tuple[float, float]:
    """Best seconds of one small training step (projection, attention, backward) in fp32 and bf16 autocast."""
    m, k, n = _CALIBRATION_SHAPE
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG (seeded by the run) untouched
    x = torch.randn(m, k, generator=generator, requires_grad=True)
    w = torch.randn(n, k, generator=generator, requires_grad=True)
    heads, length = 8, 16  # m rows = 16 sequences of 16 tokens; n = 1024 = q, k, v and an MLP share

    def step(dtype: torch.dtype) -> None:
        # Matmuls alone are not the whole story, so the calibration times what a training step does:
        # projections, attention as a bf16 CPU run computes it (matmul, softmax, matmul: see
        # worker.engines.training.encoder; SDPA's bf16 backward is ~10x slower on CPUs), backward.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            projected = torch.nn.functional.linear(x, w)
            q, key, v = (part.reshape(-1, length, heads, k // heads).transpose(1, 2)
                         for part in projected[:, :3 * k].split(k, dim=1))
            out = torch.matmul(torch.softmax(torch.matmul(q, key.transpose(-1, -2)) / 8.0, dim=-1), v)
        (out.float().sum() + projected[:, 3 * k:].float().sum()).backward()

    return _alternate(step, rounds)


def _time_cpu_decode(rounds: int = 6) -> tuple[float, float]:
    """Best seconds of a decode-step-shaped pass (an MLP projection and an LM head, packed) in fp32 and bf16."""
    rows, width, inner, vocab = _DECODE_CALIBRATION_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=generator)
    weights = {"mlp": torch.randn(inner, width, generator=generator) * 0.02,
               "head": torch.randn(vocab, width, generator=generator) * 0.02}
    ready = {dtype: (x.to(dtype), {name: pack_linear(w.to(dtype)) for name, w in weights.items()})
             for dtype in (torch.float32, torch.bfloat16)}
    del weights

    def step(dtype: torch.dtype) -> None:
        rows_in, packed = ready[dtype]
        with torch.inference_mode():
            hidden = linear(rows_in, packed["mlp"], None)
            linear(hidden[:, :width], packed["head"], None)

    return _alternate(step, rounds)


def _alternate(step: Callable[[torch.dtype], None], rounds: int) -> tuple[float, float]:
    """Best seconds of step(fp32) and step(bf16) over alternating rounds, after one warm-up round."""
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    # Alternating rounds with the minimum of each: another process taking the CPU for a while slows
    # both dtypes' rounds, not one. The first round only warms up (kernel selection, AMX set-up).
    for attempt in range(rounds + 1):
        for dtype in best:
            started = time.perf_counter()
            step(dtype)
            if attempt:
                best[dtype] = min(best[dtype], time.perf_counter() - started)
        if best[torch.bfloat16] > 10 * best[torch.float32]:
            break  # bf16 emulated in software: clearly slower, no need to spend seconds proving it
    return best[torch.float32], best[torch.bfloat16]


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's [out, in] weight in oneDNN's packed layout for CPU matmuls; unchanged without oneDNN.

    MKL's sgemm repacks the weight on every call, which dominates at 4-64 rows; oneDNN packs once. The dtype
    is kept (fp32 or bf16). Use with linear(), which tells the two apart by the tensor's layout.
    """
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (AttributeError, RuntimeError, NotImplementedError):
        return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str = "none",
           algorithm: str = "") -> torch.Tensor:
    """x @ weight.T + bias over a pack_linear() weight (oneDNN, with an optional fused post-op) or a plain one."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, post, [], algorithm)
    out = torch.nn.functional.linear(x, weight, bias)
    if post == "gelu":
        return torch.nn.functional.gelu(out, approximate=algorithm or "none")
    return out


def release_memory(plan: DevicePlan) -> None:
    """Free what can be freed after a model is dropped (Python garbage, CUDA cache)."""
    gc.collect()
    if plan.is_cuda:
        torch.cuda.empty_cache()


def _resolve_device_name(device: str) -> str:
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        index_text = device.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise ValueError(f"invalid device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was requested but CUDA is not available on this machine")
        index = int(index_text)
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"device {device!r} was requested but only {count} CUDA device(s) exist")
        return f"cuda:{index}"
    raise ValueError(f"invalid device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")


def bf16_supported(device: str) -> bool:
    """True when a CUDA device runs bf16 natively."""
    # Ampere (compute capability 8.0) and newer have native bf16 tensor cores; older cards
    # emulate it slowly, so "auto" picks fp16 there.
    return torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device allocation failure (CUDA's OutOfMemoryError, or the allocator's RuntimeError text)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def device_memory(plan: DevicePlan) -> int:
    """Total memory of the plan's device in bytes: the GPU's own, or on a CPU the RAM this process may use."""
    if plan.is_cuda:
        return int(torch.cuda.get_device_properties(torch.device(plan.device)).total_memory)
    return host_memory()


def host_memory() -> int:
    """Physical RAM, or the container's cgroup memory limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # cgroup v2 says "max" when unlimited
            total = min(total, int(text))
    return int(total)


def memory_in_use(device: str) -> int:
    """Bytes this process holds on `device`: allocated tensors on a GPU, resident memory on a CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.memory_allocated(torch.device(device)))
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
