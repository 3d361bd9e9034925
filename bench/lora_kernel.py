"""Batched LoRA (worker.engines.serving.lora.adapter_slots.lora_delta) against the base projection alone, for one projection of a
decode step of `--rows` rows mixing 1, 4 and 16 adapters.

Prints, per adapter count, the median time of: `base` (x W^T, the named baseline), `batched` (x W^T plus
lora_delta), `row-gather` (x W^T plus a per-row gather of A and B and two bmm, the plain BGMV formulation) and
`per-adapter` (x W^T plus one update per distinct adapter over its rows), with the ratios against `base`.
Never asserts timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from worker.engines.serving.lora.adapter_slots import lora_delta, plan_rows


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, h, r = args.device, args.hidden, args.rank
    weight = torch.randn(h, h, device=device) / h**0.5
    x = torch.randn(args.rows, 1, h, device=device)
    print(f"rows={args.rows} hidden={h} rank={r} device={device} load={os.getloadavg()[0]:.2f}")
    for adapters in (1, 4, 16):
        _measure(adapters, x, weight, args.rank, args.repeats)


def _measure(adapters: int, x: torch.Tensor, weight: torch.Tensor, r: int, repeats: int) -> None:
    """One line: the four sides for a batch spread evenly over `adapters` adapters."""
    device, h = x.device, x.shape[-1]
    a = torch.randn(adapters + 1, r, h, device=device) * 0.01
    b = torch.randn(adapters + 1, r, h, device=device) * 0.01  # B^T per slot, as LoraSlots stores it
    slots = torch.arange(x.shape[0], device=device) % adapters + 1

    def base():
        return x @ weight.T

    def batched():
        plan = plan_rows(slots, r)
        assert plan is not None
        return x @ weight.T + lora_delta(x, a, b, plan)

    def row_gather():
        return x @ weight.T + torch.bmm(torch.bmm(x, a[slots].transpose(1, 2)), b[slots])

    def per_adapter():
        out = x @ weight.T
        for slot in range(1, adapters + 1):
            rows = (slots == slot).nonzero().squeeze(1)
            out[rows] += x[rows] @ a[slot].T @ b[slot]
        return out

    times = [_median_ms(fn, repeats) for fn in (base, batched, row_gather, per_adapter)]
    print(f"adapters={adapters:2d} base={times[0]:.3f}ms " + " ".join(
        f"{name}={t:.3f}ms ({t / times[0]:.2f}x)"
        for name, t in zip(("batched", "row-gather", "per-adapter"), times[1:], strict=True)))


if __name__ == "__main__":
    main()
