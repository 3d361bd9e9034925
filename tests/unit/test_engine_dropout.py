"""FastDropout: Bernoulli keep-masks with the right rate and scale, seeded, a no-op in eval mode."""

from __future__ import annotations

import pytest
import torch

from worker.engines.training.dropout import FastDropout, keep_mask, use_fast_dropout


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_rate_and_scale_keep_the_expectation(p):
    torch.manual_seed(0)
    keep, scale = keep_mask((399_999,), p)
    mask = keep.float() * scale
    dropped = (mask == 0).float().mean().item()
    assert abs(dropped - p) < 0.005
    kept = mask[mask != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)), rtol=1e-4, atol=0)
    assert abs(mask.mean().item() - 1.0) < 0.01
    slices = mask.view(-1, 3)  # each of the three 16-bit slices of a draw drops at rate p
    for column in range(3):
        assert abs((slices[:, column] == 0).float().mean().item() - p) < 0.01
    # Neighbouring elements (slices of one draw) are independent: the pair dropped rate is p squared.
    pairs = (slices[:, 0] == 0) & (slices[:, 2] == 0)
    assert abs(pairs.float().mean().item() - p * p) < 0.01


def test_seeded_like_torch_dropout_and_odd_shapes():
    layer = FastDropout(0.25)
    layer.train()
    x = torch.randn(5, 7, 11)  # 385 elements: not a multiple of three
    torch.manual_seed(3)
    first = layer(x)
    torch.manual_seed(3)
    assert torch.equal(layer(x), first)
    assert first.shape == x.shape and first.dtype == x.dtype
    zeroed = first == 0
    torch.testing.assert_close(first[~zeroed], x[~zeroed] / 0.75, rtol=1e-3, atol=1e-6)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_eval_mode_and_zero_rate_are_the_identity_and_gradients_follow_the_mask():
    layer = FastDropout(0.3)
    x = torch.randn(64, 32, requires_grad=True)
    layer.eval()
    assert torch.equal(layer(x), x)
    layer.train()
    out = layer(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out / x).detach().nan_to_num())
    assert torch.equal(FastDropout(0.0).train()(x), x)


def test_use_fast_dropout_swaps_modules_without_changing_what_is_saved():
    nested = torch.nn.Sequential(torch.nn.Dropout(0.2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1), nested)
    before = list(model.state_dict())
    assert use_fast_dropout(model) == 2
    assert all(type(m) is FastDropout for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert list(model.state_dict()) == before
    assert model[2][0].p == 0.2
