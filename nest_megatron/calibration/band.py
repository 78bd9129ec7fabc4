"""The error band of a predicted step time, from a calibration's cross-validated errors (one formula, used by every
report).

With errors e = predicted / measured - 1 of the runs the calibration held out, a run predicted at t measured
t / (1 + e); the band spans that for the 5th to the 95th percentile of e (with few runs, nearly their extremes),
and reaches t itself where those percentiles are of one sign: one run's error alone would give a band of no width
beside the prediction.
"""

from __future__ import annotations

import numpy as np

BAND_PERCENTILES = (5.0, 95.0)


def band(step_s: float, errors) -> tuple[float, float] | None:
    """(low, high) step time of what a run predicted at `step_s` would measure; None without errors."""
    if len(errors) == 0:
        return None
    low_error, high_error = np.percentile(np.asarray(errors, dtype=float), BAND_PERCENTILES)
    return min(step_s, step_s / (1 + float(high_error))), max(step_s, step_s / (1 + float(low_error)))


def overlaps(step_s: float, best_s: float, errors) -> bool:
    """Whether the bands of a plan at `step_s` and of the best at `best_s` overlap: tied within the model's error."""
    mine, best = band(step_s, errors), band(best_s, errors)
    return mine is not None and mine[0] <= best[1] and best[0] <= mine[1]
