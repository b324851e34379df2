"""fits_budget's direction: a predicted peak fits when the peak and its margin, a share of the
peak, are within the budget; at the margin's edge and one byte around it."""

from __future__ import annotations

import pytest

from batchfit.train.memory.fitting import fits_budget


@pytest.mark.parametrize(
    ("peak", "budget", "margin", "fits"),
    [
        (100, 105, 0.05, True),  # 100 + 5% = 105: exactly at the edge
        (100, 104, 0.05, False),  # a byte short of the margin
        (100, 100, 0.05, False),  # the peak alone fits, not with its margin
        (100, 96, 0.05, False),  # (1 - margin) would take this as fitting
        (100, 100, 0.0, True),  # no margin: the budget itself
        (100, 99, 0.0, False),
        (1000, 1010, 0.01, True),
        (1000, 1009, 0.01, False),
    ],
)
def test_the_margin_is_kept_free_above_the_peak(peak, budget, margin, fits) -> None:
    assert fits_budget(peak, budget, margin) is fits
