"""Calibration: the cost model's constants fitted to measured runs (see calibration/fit.py)."""
