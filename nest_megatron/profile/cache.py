"""The profile cache: one JSON file of measured times, keyed by what the time depends on.

Each entry is keyed by device name, dtype, what was timed (an op class — gemm, attention, memory —
or a layer kind — dense, moe, embedding, output), its shapes and the sub-graph strategy, and
records the library versions it was measured with. Writes go through a temporary file and a
rename, so an interrupted `profile` never leaves half a cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nest_megatron.errors import NestError

FORMAT = 1
OP_KINDS = ("gemm", "attention", "memory")
LAYER_KINDS = ("dense", "moe", "embedding", "output")


def default_path() -> Path:
    """$XDG_CACHE_HOME/nest-megatron/profiles.json (~/.cache when XDG_CACHE_HOME is unset)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "nest-megatron" / "profiles.json"


def cache_path(configured: str | None) -> Path:
    return Path(configured).expanduser() if configured else default_path()


@dataclass(frozen=True)
class Entry:
    """One measurement. `seconds` is the op's time, or a layer's forward + backward time."""

    device: str  # torch's name of the device: "NVIDIA H100 80GB HBM3", "cpu"
    accelerator: str  # the accelerator config it was profiled as (h100_sxm, ...); plan matches on it
    dtype: str  # bf16
    kind: str  # an OP_KINDS or LAYER_KINDS item
    shape: dict  # gemm: m, n, k; attention: b, heads, s_q, s_kv, d, causal; memory: bytes; layers: model shape, tokens
    strategy: dict  # tp, sp, cp, ep, etp, mbs (empty for ops: their shape is per rank already)
    seconds: float
    fwd_s: float | None = None  # layers: forward alone
    includes_comm: bool = False  # layers timed across real processes include their TP / EP collectives
    modelled_comm_s: float = 0.0  # layers: the TP / EP collectives the cost model charges (in `seconds` only if includes_comm)
    work: dict = field(default_factory=dict)  # flops / bytes the cost model assigns (for the fit and reports)
    versions: dict = field(default_factory=dict)  # torch, megatron.core, nest_megatron, cuda

    @property
    def key(self) -> str:
        return json.dumps([self.device, self.dtype, self.kind, self.shape, self.strategy], sort_keys=True)


class Cache:
    def __init__(self, path: Path, entries: dict[str, Entry] | None = None):
        self.path = path
        self.entries = entries or {}

    @classmethod
    def load(cls, path: Path) -> Cache:
        """The cache at `path`; an empty one when the file does not exist."""
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise NestError(f"cache={path}: not a profile cache ({err}); delete it or point cache= elsewhere") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise NestError(f"cache={path}: profile cache format {data.get('format') if isinstance(data, dict) else '?'}; "
                            f"this version reads format {FORMAT}")
        try:
            entries = [Entry(**item) for item in data["entries"]]
        except (KeyError, TypeError) as err:
            raise NestError(f"cache={path}: malformed entry ({err})") from None
        return cls(path, {e.key: e for e in entries})

    def add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry

    def select(self, *, accelerator: str, dtype: str = "bf16") -> list[Entry]:
        return [e for e in self.entries.values() if e.accelerator == accelerator and e.dtype == dtype]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entries = sorted(self.entries.values(), key=lambda e: e.key)
        text = json.dumps({"format": FORMAT, "entries": [asdict(e) for e in entries]}, indent=1)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        try:
            tmp.write_text(text)
            tmp.replace(self.path)
        except OSError as err:
            raise NestError(f"cache={self.path}: cannot write it ({err.strerror})") from None
        finally:
            tmp.unlink(missing_ok=True)  # gone after the rename; a failed write's part
