"""What every sub-command shares: consoles that drop colour off a TTY, the one-line error, atomic writes."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from nest_megatron.errors import NestError


def stdout_console() -> Console:
    return Console(no_color=not sys.stdout.isatty() or "NO_COLOR" in os.environ)


def progress_bar(*, quiet: bool) -> Progress:
    """A progress bar on stderr, shown only on a terminal; plain (no colour) when NO_COLOR is set."""
    console = Console(stderr=True, no_color="NO_COLOR" in os.environ or not sys.stderr.isatty())
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True, disable=quiet or not console.is_terminal)


def fail(command: str, error: Exception | str) -> int:
    """Print `nest-megatron CMD: error: ...` as one line on stderr; return the exit status 2."""
    err = Console(stderr=True, no_color=not sys.stderr.isatty() or "NO_COLOR" in os.environ)
    err.print(f"nest-megatron {command}: error: {error}", highlight=False, soft_wrap=True, markup=False, emoji=False)
    return 2


def check_writable(path: Path, key: str, *, folder: bool = False) -> None:
    """NestError, one line naming `key`=, unless `path` can be written: a file, or with folder=True a folder of
    files. Checked by making (and removing) a temporary folder where the first missing folder would go, so that
    long work whose result goes there fails before it starts, and nothing is left behind."""
    if folder and path.exists() and not path.is_dir():
        raise NestError(f"{key}={path}: is a file; give a folder")
    if not folder and path.is_dir():
        raise NestError(f"{key}={path}: is a folder; give a file path")
    target = path if folder else path.parent
    existing = next(p for p in (target, *target.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise NestError(f"{key}={path}: cannot create {target} ({existing} is a file)")
    action = f"cannot write in {target}" if existing == target else f"cannot create {target}"
    try:
        with tempfile.TemporaryDirectory(dir=existing, prefix=".nest-megatron-check-"):
            pass
    except OSError as err:
        raise NestError(f"{key}={path}: {action} ({err.strerror})") from None


def write_atomically(path: Path, text: str, key: str = "out") -> None:
    """Write through a temporary file and rename, so that no half-written file is ever left; a path that cannot
    be written (given as `key`=) is one NestError line, and the temporary file is removed."""
    check_writable(path, key)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"  # hidden, beside the file: the rename stays on one file system
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x") as file:
            file.write(text)
        os.replace(tmp, path)
    except OSError as err:
        raise NestError(f"{key}={path}: cannot write it ({err.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
