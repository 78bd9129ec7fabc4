"""SLURM hostlists: `n[01-12],n[21-24]`, `gpu[1-3,7]`, `r[1-2]n[01-02]`, expanded as `scontrol show
hostnames` does (ranges keep their zero padding; several bracket sets in one name multiply out, the
first varying slowest). Our own parser: the planner reads hostlists where no SLURM is installed."""

from __future__ import annotations

import itertools
import re

from nest_megatron.errors import NestError

_PART = re.compile(r"\[([^\[\]]*)\]")


def expand(hostlist: str, *, key: str = "hostlist") -> list[str]:
    """The host names of `hostlist`, in order, duplicates kept as written; one NestError line naming `key`
    for a malformed list."""
    names: list[str] = []
    for item in _split_top(hostlist, key):
        names += _expand_one(item, hostlist, key)
    return names


def _split_top(hostlist: str, key: str) -> list[str]:
    """The comma-separated items outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise NestError(f"{key}={hostlist}: nested '[' at character {i + 1}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NestError(f"{key}={hostlist}: ']' without '[' at character {i + 1}")
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise NestError(f"{key}={hostlist}: '[' without ']'")
    items.append(hostlist[start:])
    items = [item.strip() for item in items]
    if not hostlist.strip() or any(not item for item in items):
        raise NestError(f"{key}={hostlist!r}: an empty host name; write names or ranges like n[01-12],n20")
    return items


def _expand_one(item: str, hostlist: str, key: str) -> list[str]:
    pieces = _PART.split(item)  # literal, range, literal, range, ..., literal
    choices = [[pieces[0]]]
    for ranges, literal in zip(pieces[1::2], pieces[2::2]):
        choices.append(_numbers(ranges, hostlist, key))
        choices.append([literal])
    if any(not re.fullmatch(r"[A-Za-z0-9._-]*", lit) for lit in pieces[0::2]):
        raise NestError(f"{key}={hostlist}: {item!r} is not a host name (letters, digits, . _ - and [ranges])")
    return ["".join(parts) for parts in itertools.product(*choices)]


def _numbers(ranges: str, hostlist: str, key: str) -> list[str]:
    """`01-03,7` -> 01 02 03 7: each bound's width pads its range."""
    out = []
    for part in ranges.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not m:
            raise NestError(f"{key}={hostlist}: [{ranges}] is not a list of numbers and ranges like [01-12,20]")
        first, last = m.group(1), m.group(2) or m.group(1)
        if int(last) < int(first):
            raise NestError(f"{key}={hostlist}: range {first}-{last} runs backwards")
        width = len(first)
        out += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return out
