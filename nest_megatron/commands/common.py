"""What every sub-command shares: consoles that drop colour off a TTY, the one-line error, atomic writes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rich.console import Console


def stdout_console() -> Console:
    return Console(no_color=not sys.stdout.isatty() or "NO_COLOR" in os.environ)


def fail(command: str, error: Exception | str) -> int:
    """Print `nest-megatron CMD: error: ...` as one line on stderr; return the exit status 2."""
    err = Console(stderr=True, no_color=not sys.stderr.isatty() or "NO_COLOR" in os.environ)
    err.print(f"nest-megatron {command}: error: {error}", highlight=False, soft_wrap=True, markup=False, emoji=False)
    return 2


def write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so that no half-written file is ever left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
