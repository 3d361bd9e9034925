"""RowSparseAdamW on sparse embedding gradients gives dense AdamW's parameters and resumes from either's state."""

from __future__ import annotations

import copy

import pytest
import torch

from worker.engines.training.sparse_adamw import RowSparseAdamW, clip_gradients


class Model(torch.nn.Module):
    """A table most rows of which no batch looks up, plus a dense layer."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(50, 8, sparse=sparse)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(dim=1)).logsumexp(dim=-1).mean()


def batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    # Rows 0-29 only, repeated within a batch (duplicate lookups), some steps touching a row for the first time.
    return [torch.randint(0, 10 + 2 * step, (4, 5), generator=generator) for step in range(count)]


def train(model: Model, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], clip: float | None) -> list[float]:
    norms = []
    for step, ids in enumerate(data):
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * (1 - step / 20)
        model(ids).backward()
        if clip is not None:
            norms.append(float(clip_gradients(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def groups(model: Model) -> list[dict]:
    return [{"params": [model.table.weight, model.head.weight], "weight_decay": 0.1},
            {"params": [model.head.bias], "weight_decay": 0.0}]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("clip", [None, 0.05])  # 0.05: clipping active on most steps
def test_sparse_rows_match_dense_adamw(fused, clip):
    dense, sparse = Model(sparse=False), Model(sparse=True)
    data = batches(12)
    dense_norms = train(dense, torch.optim.AdamW(groups(dense), lr=0.05, fused=fused), data, clip)
    sparse_norms = train(sparse, RowSparseAdamW(groups(sparse), lr=0.05, fused=fused), data, clip)
    torch.testing.assert_close(sparse_norms, dense_norms, rtol=1e-5, atol=1e-7)
    for name, expected in dense.state_dict().items():
        torch.testing.assert_close(sparse.state_dict()[name], expected, rtol=1e-5, atol=1e-7, msg=name)
    # Rows never looked up moved by weight decay alone, as dense AdamW moves them.
    untouched = torch.arange(40, 50)
    torch.testing.assert_close(sparse.table.weight[untouched], dense.table.weight[untouched])
    assert not torch.equal(sparse.table.weight[untouched], Model(sparse=False).table.weight[untouched])


def test_resumes_from_a_dense_adamw_state_and_the_other_way():
    data = batches(10)
    reference = Model(sparse=False)
    train(reference, torch.optim.AdamW(groups(reference), lr=0.05), data, 1.0)

    # Dense for 5 steps, then its state_dict continues as sparse rows (the "active" mask derived from moments).
    first = Model(sparse=False)
    optimizer = torch.optim.AdamW(groups(first), lr=0.05)
    train(first, optimizer, data[:5], 1.0)
    second = Model(sparse=True)
    second.load_state_dict(first.state_dict())
    resumed = RowSparseAdamW(groups(second), lr=0.05)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for group in resumed.param_groups:  # the schedule continues where the first part stopped
        group["lr"] = 0.05
    train_from(second, resumed, data, 5, 1.0)
    torch.testing.assert_close(second.table.weight, reference.table.weight, rtol=1e-5, atol=1e-7)

    # And a sparse-rows state resumes as dense AdamW (its extra row mask is ignored).
    third = Model(sparse=False)
    third.load_state_dict(second.state_dict())
    dense_again = torch.optim.AdamW(groups(third), lr=0.05)
    dense_again.load_state_dict(copy.deepcopy(resumed.state_dict()))
    assert "active" in resumed.state_dict()["state"][0]


def train_from(model: Model, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], start: int,
               clip: float) -> None:
    for step in range(start, len(data)):
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * (1 - step / 20)
        model(data[step]).backward()
        clip_gradients(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_clip_gradients_without_sparse_is_clip_grad_norm():
    model, expected = Model(sparse=False), Model(sparse=False)
    for each in (model, expected):
        each(batches(1)[0]).backward()
    got = clip_gradients(model.parameters(), 0.01)
    want = torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.01)
    torch.testing.assert_close(got, want)
    for a, b in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
