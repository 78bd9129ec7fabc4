"""Training logs of Megatron-LM, Megatron-Bridge and NeMo 2, read into what a calibration needs: the run's
arguments, its step times and its memory reports. Pure text parsing; every problem is one NestError line that
names the file and the line.

What each framework prints, at the commits cited (the parser accepts exactly these formats, behind torchrun's
`[default0]:` / `[rank0]:` tee prefixes and srun's `--label` `0: `):

- Megatron-LM (d98e8a6): the arguments block, megatron/training/arguments.py:1990-2001 `_print_args`
  (`------------------------ arguments ------------------------`, then `'  {} {} {}'.format(arg, '.' * (48 -
  len(arg)), value)` for every attribute of the parsed and validated namespace, sorted case-insensitively, then
  `-------------------- end of arguments ---------------------`); the iteration line, megatron/training/
  training.py:3567-3653 `training_log` (` [%Y-%m-%d %H:%M:%S.%f] iteration {:8d}/{:8d} | consumed samples:
  {:12d} | elapsed time per iteration (ms): {:.1f} |` [` throughput per GPU (TFLOP/s/GPU): {:.1f} |`] ...
  ` global batch size: {:5d} |` ...), printed by the last rank after the first iteration and every
  --log-interval; the memory report, megatron/training/utils/common_utils.py:313-334 `report_memory`
  (`[Rank {}] (after {} iterations) memory (MB) | allocated: {:.2f} | max allocated: {:.2f} | reserved: ... |
  max reserved: ...`); the vocabulary, megatron/training/vocab_utils.py:35-39 (` > padded vocab (size: {}) with
  {} dummy tokens (new size: {})`), since the arguments block is printed before the tokenizer sets it.
- Megatron-Bridge (067f987): the same iteration line (src/megatron/bridge/training/utils/train_utils.py:
  1088-1140, its timestamp without microseconds) and a memory report in GB (:1141-1148); the configuration as
  `ConfigContainer.log_non_default_values` prints it (src/megatron/bridge/training/config.py:1809-1875: the
  model's, DDP's and optimizer's fields that differ from megatron-core's defaults, `  name: repr  (Mcore default:
  repr)`, and every non-None field of [train], [dataset], [tokenizer], ... as `  name: repr`), and the sizes
  (src/megatron/bridge/training/initialize.py:785 `> initialized HyperCommGrid with tp=, pp=, cp=, dp=`).
- NeMo 2 (8cfedd7): nemo/lightning/pytorch/callbacks/progress_printer.py:55-63,141-144 (`Training epoch E,
  iteration N/M | name: value | ...`, among them `train_step_timing in s: {:.4}` from nemo/utils/exp_manager.py
  :455-465 TimingCallback). NeMo 2 prints no configuration: the command line gives it (model=..., plan.*).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from nest_megatron.errors import NestError

# torchrun --tee's `[default0]:`, torch's `[rank0]:`, srun --label's `0: ` (any combination, in that order)
PREFIX = re.compile(r"^(?:\s*\d+: )?(?:\[(?:default|rank)\d+\]:)?")
ARGS_START = re.compile(r"^-{24} arguments -{24}$")
ARGS_END = re.compile(r"^-{20} end of arguments -{21}$")
ARGS_LINE = re.compile(r"^  (\S+) \.*(?: (.*))?$")
ITERATION = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\] iteration +(\d+)/ *(\d+) \|(?P<rest>.*)$")
ELAPSED = re.compile(r" elapsed time per iteration \(ms\): ([0-9.]+) \|")
THROUGHPUT = re.compile(r" throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+) \|")
GLOBAL_BATCH = re.compile(r" global batch size: +(\d+) \|")
MEMORY = re.compile(r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \((MB|GB)\)(?P<rest>( \| [^|]+: [0-9.]+)+)$")
PADDED_VOCAB = re.compile(r"^ ?> padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)$")
BRIDGE_SUMMARY = "Configuration Summary (Non-Default Values vs Megatron Core)"
BRIDGE_SECTION = re.compile(r"^\[(\w+)\](?: Non-default values \(vs Mcore \w+\))?:$")
BRIDGE_VALUE = re.compile(r"^  (\w+): (.*?)(?:  \(Mcore default: .*\))?$")
BRIDGE_GRID = re.compile(r"^> initialized HyperCommGrid with tp=(\d+), pp=(\d+), cp=(\d+), dp=(\d+)$")
NEMO_STEP = re.compile(r"^Training epoch (\d+), iteration (\d+)/(\d+)(?P<rest>( \| [^|]+: [^|]+)+)$")
MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class Iteration:
    """One logged interval: the mean step time over the iterations since the previous line."""

    iteration: int
    step_s: float
    where: str  # file:line
    tflops_per_gpu: float | None = None
    global_batch_size: int | None = None


@dataclass
class RunLog:
    """What one run's log(s) say."""

    source: str  # the file (or run directory) read
    format: str  # megatron | bridge | nemo2
    arguments: dict[str, str] = field(default_factory=dict)  # namespace attribute (or config field) -> printed value
    where: dict[str, str] = field(default_factory=dict)  # attribute -> file:line
    iterations: list[Iteration] = field(default_factory=list)
    peak_memory_bytes: float | None = None  # the largest "max allocated" any rank reported
    padded_vocab: tuple[int, int] | None = None  # (the tokenizer's size, padded) from the padded-vocab line
    sizes: dict[str, int] = field(default_factory=dict)  # Bridge's HyperCommGrid line: tp, pp, cp, dp
    arguments_at: str = ""  # file:line of the arguments block (or configuration summary)

    def value(self, name: str):
        """The printed value of `name` as a Python value (None, True, 1, 'rope', (128, 0), [1, 0]); None when
        the log does not print it."""
        return python_value(self.arguments.get(name))

    @property
    def measured_step_s(self) -> float:
        """The median step time of the logged intervals, the first left out when there are others: Megatron logs
        it to show the start-up (training.py:3557-3559), and it includes it."""
        import statistics

        times = [it.step_s for it in self.iterations]
        return statistics.median(times[1:] if len(times) > 1 else times)


def python_value(text: str | None):
    """A printed value back as Python: literals by ast, `EnumName.member` as the member's name, else the text."""
    if text is None:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        enum = re.fullmatch(r"[A-Z]\w*\.(\w+)", text)
        return enum.group(1) if enum else text


def strip_prefix(line: str) -> str:
    return PREFIX.sub("", line.rstrip("\r\n"), count=1)


def read(path: Path) -> RunLog:
    """One log file."""
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        raise NestError(f"{path}: cannot read it ({err.strerror})") from None
    if not text.strip():
        raise NestError(f"{path}: empty; give the log of a Megatron-LM, Megatron-Bridge or NeMo 2 training run")
    log = parse([(str(path), text)], source=str(path))
    check(log)
    return log


def parse(files: list[tuple[str, str]], *, source: str) -> RunLog:
    """The logs of one run (one file, or the ranks' files of a run directory), merged: the arguments from the
    file that prints them, the iterations from the one that does (the last rank), memory from every rank."""
    log = RunLog(source=source, format="")
    for name, text in files:
        _parse_file(log, name, text.splitlines())
    return log


def _parse_file(log: RunLog, name: str, lines: list[str]) -> None:
    block_start = None
    section = None
    for number, raw in enumerate(lines, start=1):
        line = strip_prefix(raw)
        where = f"{name}:{number}"
        if block_start is not None:
            if ARGS_END.match(line):
                block_start = None
                continue
            entry = ARGS_LINE.match(line)
            if entry is None:
                raise NestError(f"{name}:{block_start}: the arguments block that starts here is cut at line {number} "
                                f"({line[:60]!r} is not an argument); a truncated or interleaved log?")
            log.arguments[entry.group(1)] = entry.group(2) or ""
            log.where[entry.group(1)] = where
            continue
        if ARGS_START.match(line):
            # A restart prints the block again: the run is the last one the log holds.
            log.format, log.arguments, log.where, log.iterations = "megatron", {}, {}, []
            log.arguments_at, block_start = where, number
            continue
        if line.strip() == BRIDGE_SUMMARY:
            log.format, log.arguments, log.where, log.iterations = "bridge", {}, {}, []
            log.arguments_at, section = where, ""
            continue
        if section is not None:
            head = BRIDGE_SECTION.match(line)
            if head:
                section = head.group(1)
                continue
            entry = BRIDGE_VALUE.match(line)
            if entry and section:
                # the model's fields by their own names (Megatron's argument names); the others under section.name
                key = entry.group(1) if section in ("model", "ddp", "optimizer", "train") else f"{section}.{entry.group(1)}"
                log.arguments.setdefault(key, entry.group(2))
                log.where.setdefault(key, where)
                continue
            if line.startswith("=" * 70):
                section = None if log.arguments else section
            continue
        if (it := ITERATION.match(line)) is not None:
            if line.rstrip().endswith("|"):  # Megatron's and Bridge's lines end with their last field's " |"
                log.iterations.append(_iteration(it, where, line))
            elif number == len(lines):
                raise NestError(f"{where}: the last iteration line is cut ({line.strip()[:60]!r}...); a truncated log?")
            continue  # a line another rank's output broke in two: not a measurement
        if (memory := MEMORY.match(line)) is not None:
            _memory(log, memory)
            continue
        if (vocab := PADDED_VOCAB.match(line)) is not None:
            log.padded_vocab = (int(vocab.group(1)), int(vocab.group(3)))
            continue
        if (grid := BRIDGE_GRID.match(line)) is not None:
            log.sizes = dict(zip(("tp", "pp", "cp", "dp"), map(int, grid.groups())))
            continue
        if (step := NEMO_STEP.match(line)) is not None:
            _nemo_step(log, step, where)
            continue
    if block_start is not None:
        raise NestError(f"{name}:{block_start}: the arguments block that starts here does not end (no 'end of "
                        f"arguments' line): a truncated log?")


def _iteration(match: re.Match, where: str, line: str) -> Iteration:
    rest = match.group("rest")
    elapsed = ELAPSED.search(rest)
    if elapsed is None:
        raise NestError(f"{where}: an iteration line without 'elapsed time per iteration (ms)' "
                        f"({line.strip()[:60]!r}...); a truncated log?")
    throughput, batch = THROUGHPUT.search(rest), GLOBAL_BATCH.search(rest)
    return Iteration(int(match.group(1)), float(elapsed.group(1)) / 1e3, where,
                     float(throughput.group(1)) if throughput else None, int(batch.group(1)) if batch else None)


def _memory(log: RunLog, match: re.Match) -> None:
    unit = MIB if match.group(3) == "MB" else GIB
    metrics = dict(item.split(": ") for item in match.group("rest").split(" | ")[1:])
    peak = next((metrics[k] for k in ("max allocated", "max_allocated", "mem-max-allocated-gigabytes") if k in metrics),
                None)
    if peak is not None:
        value = float(peak) * unit
        log.peak_memory_bytes = max(log.peak_memory_bytes or 0.0, value)


def _nemo_step(log: RunLog, match: re.Match, where: str) -> None:
    metrics = dict(item.split(": ", 1) for item in match.group("rest").split(" | ")[1:])
    if "train_step_timing in s" not in metrics:
        return
    if not log.format:
        log.format = "nemo2"
    batch = metrics.get("global_batch_size")
    log.iterations.append(Iteration(int(match.group(2)) + 1, float(metrics["train_step_timing in s"]), where,
                                    global_batch_size=int(float(batch)) if batch else None))


def check(log: RunLog) -> None:
    """A log a calibration can use: a configuration and at least one finished iteration."""
    if not log.format:
        raise NestError(f"{log.source}: no Megatron-LM arguments block ('---- arguments ----', printed by "
                        "megatron/training/arguments.py _print_args at start), no Megatron-Bridge configuration "
                        "summary and no NeMo 2 step line: not a training log this reads")
    if not log.iterations:
        raise NestError(f"{log.source}: no iteration finished (no 'elapsed time per iteration (ms)' line after the "
                        f"{'arguments at ' + log.arguments_at if log.arguments_at else 'start'}); a run that stopped "
                        "before its first logged iteration has no step time")
