"""AdamW that updates a large embedding table from sparse (looked-up rows only) gradients, with AdamW's result.

A BERT classifier's 30k-row word-embedding table is about half of a small model's parameters, but a batch of
short texts looks up a few hundred rows. A dense gradient costs a zeroed 30k x width buffer every step, a norm
and a clipping pass over it, and AdamW reading and writing all of it; measured on a 2-core CPU in bf16 about
15% of a MiniLM-L6 step. With `nn.Embedding(sparse=True)` backward gives only the rows looked up, and
`RowSparseAdamW` keeps the exact AdamW update:

- A row never looked up so far has zero moments, so AdamW's step moves it by weight decay alone
  (p *= 1 - lr * weight_decay): one multiply over the table, no gradient or moments read.
- A row looked up at least once ("active") has moments that keep decaying even in steps that do not touch
  it, so every active row takes the full Adam step each step (gathered, updated by the fused kernel with the
  group's step count, scattered back). Bias correction uses the global step, as dense AdamW's does.

This is not "lazy Adam" (which skips the untouched rows' moment decay and so computes something else): the
parameters match `torch.optim.AdamW` on dense gradients to rounding (tests/unit/test_engine_sparse_rows.py).
It pays while the active rows are a part of the table (short runs touch a fraction of the vocabulary).
The loop enables it only in one-process runs (DDP reduces dense gradients).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


class RowSparseAdamW(torch.optim.AdamW):
    """torch.optim.AdamW that also takes sparse row gradients (see the module doc); dense ones as AdamW does.

    Which path a parameter takes follows its gradient, so the parameter groups and the state keys are
    AdamW's own (plus a row mask): a checkpoint of either resumes with the other.
    """

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        """AdamW's step for dense gradients (fused where configured), then the row step for sparse ones."""
        sparse = [(group, p, p.grad) for group in self.param_groups
                  for p in group["params"] if p.grad is not None and p.grad.is_sparse]
        for _, p, _ in sparse:
            p.grad = None  # AdamW skips parameters without a gradient (and cannot take sparse ones)
        try:
            loss = super().step(closure)
        finally:
            for _, p, grad in sparse:
                p.grad = grad
        for group, p, grad in sparse:
            self._row_step(group, p, grad)
        return loss

    def _row_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        if "active" not in state:  # a dense AdamW's state: the rows it moved are those with moments
            state["active"] = (state["exp_avg_sq"] != 0).any(dim=1) | (state["exp_avg"] != 0).any(dim=1)
        elif state["active"].dtype != torch.bool:  # Optimizer.load_state_dict casts state to the parameter's dtype
            state["active"] = state["active"] != 0
        grad = grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        active = state["active"]
        active[rows] = True
        state["step"] += 1
        lr, weight_decay = group["lr"], group["weight_decay"]
        if weight_decay:
            p.mul_(1 - lr * weight_decay)  # every row, as AdamW's decoupled decay (active rows included)
        index = active.nonzero().squeeze(1)
        where = (active.cumsum(0) - 1).index_select(0, rows)  # each gradient row's place among the active rows
        weights, exp_avg, exp_avg_sq = (t.index_select(0, index) for t in (p, state["exp_avg"], state["exp_avg_sq"]))
        row_grad = torch.zeros_like(weights).index_copy_(0, where, values.to(weights.dtype))
        beta1, beta2 = group["betas"]
        torch._fused_adamw_([weights], [row_grad], [exp_avg], [exp_avg_sq], [], [state["step"].clone()],
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=group["eps"], amsgrad=False,
                            maximize=group["maximize"])
        p.index_copy_(0, index, weights)
        state["exp_avg"].index_copy_(0, index, exp_avg)
        state["exp_avg_sq"].index_copy_(0, index, exp_avg_sq)


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ (foreach) over dense and sparse gradients alike; returns the total norm before clipping.

    Sharded gradients (FSDP's DTensors) give the norm over all ranks' shards, the one-process norm: each rank
    clips its shard by the same coefficient. Every rank must call it then (the norm is a collective).
    """
    grads = [(p, p.grad) for p in parameters if p.grad is not None]
    params = [p for p, _ in grads]
    if not any(grad.is_sparse for _, grad in grads):
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        # A DTensor norm: full_tensor() is the global value, the same on every rank.
        return total.full_tensor() if isinstance(total, DTensor) else total
    sparse = [grad.coalesce() if grad.is_sparse else grad for _, grad in grads]  # a row looked up twice: 2 entries
    for p, grad in zip(params, sparse, strict=True):
        p.grad = grad
    dense = [grad for grad in sparse if not grad.is_sparse]
    rows = [grad for grad in sparse if grad.is_sparse]
    norms = [torch.linalg.vector_norm(grad.values()) for grad in rows]
    if dense:
        norms.append(torch.nn.utils.get_total_norm(dense, foreach=True))
    total = torch.linalg.vector_norm(torch.stack(norms))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if dense:
        torch._foreach_mul_(dense, coefficient)
    for grad in rows:
        grad.values().mul_(coefficient)
    return total
