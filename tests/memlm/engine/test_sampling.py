"""The engine's choice of tokens (memlm.engine.sampling): argmax_rows is torch.argmax, ties and NaN included.

Shape legend: R rows, V vocab.
"""

from __future__ import annotations

import pytest
import torch

from memlm.engine.sampling import argmax_rows


def rows_with_ties(seed: int) -> torch.Tensor:
    """(7, 997) float32 with the row maximum planted twice or three times in some rows, -inf and NaN in others."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 997, generator=g)  # (R, V)
    x[1, [5, 600]] = 9.0  # a tie: the first one wins
    x[2, :] = float("-inf")
    x[2, 400] = -3.0
    x[3, :] = float("-inf")  # every value -inf: index 0
    x[4, 70] = float("nan")  # NaN counts as the largest
    x[5, [10, 20, 30]] = x[5].max() + 1.0  # a three-way tie above everything else in the row
    x[6, [300, 40]] = float("nan")  # several NaN: the first one
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_argmax_rows_is_torch_argmax_with_ties_inf_nan_and_views(seed: int, monkeypatch) -> None:
    x = rows_with_ties(seed)
    assert argmax_rows(x)[[1, 3, 4, 5, 6]].tolist() == [5, 0, 70, 10, 40]
    # The numpy path must be the one that runs for CPU float32 rows whose last dimension is contiguous.
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("torch's argmax ran"))
    for view in (x, x[:, :500], x[:, 3:], x[1:2], x[:0]):
        got = argmax_rows(view)
        assert got.dtype == torch.int64 and got.shape == (view.shape[0],)
        monkeypatch.undo()
        assert torch.equal(got, view.argmax(dim=-1))
        monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("torch's argmax ran"))


def test_argmax_rows_other_layouts_and_dtypes_take_torch_argmax() -> None:
    x = rows_with_ties(0)
    for y in (x.to(torch.bfloat16), x.to(torch.float64), x.t().contiguous().t()):  # the last: columns contiguous
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1))
    with pytest.raises(ValueError, match="rows"):
        argmax_rows(x[0])
