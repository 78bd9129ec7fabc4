"""A calibration profile: the constants a calibration fitted, and how far off it has been on runs it was not
fitted to, which gives every prediction its error band.

`nest-megatron calibrate` writes a profile (`write_profile`); `calibration=PATH` (or the environment variable
NEST_MEGATRON_CALIBRATION) makes `plan`, `evaluate`, `explain` and `launch` price with its constants
(config/load.py applies them). Without one, a plan is priced with the shipped constants (the accelerator config),
and its band comes from the shipped calibration's cross-validated errors on the published runs
(calibration/shipped/<accelerator>.yaml, written by scripts/fit_calibration.py).

The band of a predicted step time comes from the errors of the calibration's cross-validation (leave-one-out for a
user's calibration; for the shipped one, the cross-validation its file names): calibration/band.py.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from nest_megatron.calibration.band import band
from nest_megatron.calibration.constants import CONSTANTS
from nest_megatron.errors import NestError

ENV = "NEST_MEGATRON_CALIBRATION"
FORMAT = "nest-megatron calibration"  # the profile's first key, so that another YAML file is told apart
VERSION = 1
SHIPPED = Path(__file__).resolve().parent / "shipped"


@dataclass(frozen=True)
class Calibration:
    """The constants that price a plan and the cross-validated errors of the calibration that chose them."""

    label: str  # how a report names it: "shipped H100 calibration", "calibration cal.yaml"
    accelerator: str
    values: dict[str, float] = field(default_factory=dict)  # constant name -> value (empty: the shipped ones)
    method: str = ""  # the cross-validation the errors come from: leave-one-out, leave-one-source-out, ...
    errors: tuple[float, ...] = ()  # predicted / measured - 1 of each held-out run
    path: str | None = None  # the profile file; None for the shipped calibration
    note: str = ""  # what else a reader should know (the runs were of another accelerator, ...)
    levels: dict[int, str] = field(default_factory=dict)  # network level -> its name, of each fitted per-level efficiency

    @property
    def runs(self) -> int:
        return len(self.errors)

    @property
    def median_abs_error(self) -> float:
        return float(np.median(np.abs(self.errors))) if self.errors else math.nan

    @property
    def worst_abs_error(self) -> float:
        return float(np.max(np.abs(self.errors))) if self.errors else math.nan

    @property
    def bias(self) -> float:
        return float(np.median(self.errors)) if self.errors else math.nan

    def band(self, step_s: float) -> tuple[float, float] | None:
        """(low, high) of what a run predicted at `step_s` measured, by the cross-validated errors; None without."""
        return band(step_s, self.errors)

    def summary(self) -> str:
        """`shipped H100 calibration: cross-validated median 3.1 %, worst 14 % (57 runs, leave-one-source-out)`."""
        if not self.errors:
            return f"{self.label}: no cross-validated error ({self.note or 'no runs'})"
        text = (f"{self.label}: cross-validated median {self.median_abs_error:.1%}, worst {self.worst_abs_error:.0%} "
                f"({self.runs} runs, {self.method})")
        return text + (f"; {self.note}" if self.note else "")

    def to_plan(self, step_s: float) -> dict:
        """What the Plan JSON records of the calibration that priced it."""
        band = self.band(step_s)
        return {"label": self.label, "path": self.path, "accelerator": self.accelerator, "values": dict(self.values),
                "method": self.method, "runs": self.runs, "median_abs_error": _finite(self.median_abs_error),
                "bias": _finite(self.bias), "worst_abs_error": _finite(self.worst_abs_error),
                "errors": list(self.errors), "note": self.note, "summary": self.summary(),
                "step_time_band_s": list(band) if band else None}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# --- files -----------------------------------------------------------------------------------------------------

def _fail(path, what: str) -> NestError:
    return NestError(f"{path}: {what}; give a profile `nest-megatron calibrate ... out=PROFILE.yaml` wrote")


def read_profile(path: str) -> Calibration:
    """A profile written by `nest-megatron calibrate`, checked: its constants are known and inside their bounds."""
    file = Path(path).expanduser()
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as err:
        raise _fail(path, f"cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise _fail(path, f"not YAML ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(path, f"not a calibration profile (no 'format: {FORMAT}')")
    if data.get("version") != VERSION:
        raise _fail(path, f"version {data.get('version')}; this nest-megatron reads version {VERSION}")
    constants = data.get("constants")
    if not isinstance(constants, dict) or not isinstance(data.get("accelerator"), str):
        raise _fail(path, "no accelerator or constants")
    values, levels = {}, {}
    for name, entry in constants.items():
        if name not in CONSTANTS:
            raise _fail(path, f"constants.{name}: unknown; known: {', '.join(CONSTANTS)}")
        value = entry.get("value") if isinstance(entry, dict) else None
        low, high = CONSTANTS[name].bounds
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
            raise _fail(path, f"constants.{name}.value={value}: must be a number in {low}..{high}")
        # Only what the runs determined prices a plan: a kept prior stays the shipped value, whatever it becomes.
        if entry.get("fitted"):
            values[name] = float(value)
            if entry.get("level"):
                levels[int(name.rpartition(".")[2])] = str(entry["level"])
    cross = data.get("leave_one_out") or {}
    errors = tuple(float(e) for e in cross.get("errors") or ())
    return Calibration(label=f"calibration {file.name}", accelerator=data["accelerator"], values=values,
                       method="leave-one-out", errors=errors, path=str(file.resolve()), levels=levels)


def check_levels(calibration: Calibration, level_names: list[str], where: str) -> None:
    """A fitted network efficiency prices the level it was fitted on: the plan's cluster must have it, by name."""
    for index, name in calibration.levels.items():
        mine = level_names[index] if index < len(level_names) else None
        if mine != name:
            raise NestError(f"{where}: a network efficiency was fitted on level {index} '{name}', but this "
                            f"cluster's level {index} is {repr(mine) if mine else 'missing'}; plan on the cluster it "
                            "was calibrated on")


def write_profile(data: dict) -> str:
    """The profile's YAML text (the caller writes it atomically)."""
    return yaml.safe_dump({"format": FORMAT, "version": VERSION, **data}, sort_keys=False, allow_unicode=True,
                          width=120)


@functools.lru_cache(maxsize=None)
def _shipped_file(file: Path) -> dict:
    """A shipped file, parsed once a process (every load() asks for it; PyYAML's pure-Python parser is slow)."""
    return yaml.safe_load(file.read_text())


def shipped(accelerator: str) -> Calibration:
    """The shipped calibration's errors for `accelerator`: its own file, else the file whose constants it uses."""
    own = SHIPPED / f"{accelerator}.yaml"
    files = [own] if own.exists() else sorted(SHIPPED.glob("*.yaml"))
    for file in files:
        data = _shipped_file(file)
        if own.exists() or accelerator in data.get("applies_to", ()):
            return _shipped(data, accelerator, note="")
    if files:
        data = _shipped_file(files[0])
        return _shipped(data, accelerator, note=f"no measured runs of {accelerator}: the errors of "
                                                f"{data['accelerator']}'s runs")
    return Calibration(label="shipped constants", accelerator=accelerator, note="no calibration runs")


def _shipped(data: dict, accelerator: str, *, note: str) -> Calibration:
    cross = data["band_from"]
    return Calibration(label=data["label"], accelerator=accelerator, method=cross,
                       errors=tuple(data["cross_validation"][cross]["errors"]), note=note)


def from_config(path: str | None, accelerator: str) -> Calibration:
    """`calibration=PATH`, else NEST_MEGATRON_CALIBRATION, else the shipped calibration; a profile of another
    accelerator is one line."""
    chosen = path or os.environ.get(ENV) or None
    if chosen is None:
        return shipped(accelerator)
    where = f"calibration={chosen}" if path else f"{ENV}={chosen}"
    try:
        calibration = read_profile(chosen)
    except NestError as err:
        raise NestError(f"{where}: {str(err).split(': ', 1)[-1]}") from None
    if calibration.accelerator != accelerator:
        raise NestError(f"{where}: a calibration of {calibration.accelerator}, but the plan is for {accelerator}; "
                        f"calibrate runs of {accelerator}, or choose accelerator={calibration.accelerator}")
    return calibration
