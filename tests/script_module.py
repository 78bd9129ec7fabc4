"""Load a file that is not an installed module (a script under scripts/, a Megatron-LM source file) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_module(path: Path, name: str | None = None):
    """The module `path` defines, registered in sys.modules as `name` so that its dataclasses resolve (default
    'script_' + the file's stem: never the name pytest imports a test file under)."""
    spec = importlib.util.spec_from_file_location(name or f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
