"""Predicted against measured on this machine's NVIDIA GPUs: profile, plan, train, compare.

    bash scripts/validate_on_gpu.sh                # on a machine with 1..8 NVIDIA GPUs, < 8 minutes on one H100/H200
    bash scripts/validate_on_gpu.sh --cpu-smoke --out-dir /tmp/v   # the same steps at tiny size on a CPU (a test)

Steps:
1. `nest-megatron profile` of a ~1B-parameter Llama-style model (16 layers, hidden 2048, seq 2048,
   vocab 32,000: 0.95e9 parameters) on the local GPUs, into a fresh profile cache;
2. `nest-megatron plan` for this machine with that cache, and `evaluate` of a few hand-picked
   configurations (micro-batch 1 / 2 / 4, recompute none / selective / full, TP = 2 and PP = 2
   where there are two GPUs), each with the fitted compute model and with the shipped roofline;
3. a short real megatron-core training of each (scripts/pretrain_gpt.py under torchrun, with the
   Megatron arguments the plan emits): the median iteration time after warm-up, and the peak of
   torch.cuda.max_memory_allocated over the ranks;
4. a Markdown table of predicted against measured, written to docs/validation/<date>_<gpu>.md, and
   the profile cache copied to nest_megatron/profile/shipped/<gpu>.json (the shipped profile `plan`
   falls back to); with --out-dir DIR, both go straight into DIR instead.

The predicted memory compared is the plan's peak without its workspace allowance (CUDA context,
NCCL buffers, allocator fragmentation: accelerator.reserved_memory_gib), which
max_memory_allocated does not see.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRETRAIN = ROOT / "scripts" / "pretrain_gpt.py"
PREFIX = "validate_on_gpu"

# About 1B parameters: 16 x 51.4M per layer + 2 x 65.5M embedding and output = 0.95e9. megatron-core's
# local spec (what pretrain_gpt.py builds) runs unfused attention with its softmax in fp32 and an
# unfused SwiGLU, so the model says so.
MODEL_1B = ["model=llama2_7b", "model.name=llama_1b", "model.num_layers=16", "model.hidden_size=2048",
            "model.ffn_hidden_size=5632", "model.num_attention_heads=16", "model.num_query_groups=16",
            "model.seq_length=2048", "model.vocab_size=32000", "model.attention_backend=unfused",
            "model.attention_softmax_in_fp32=true", "model.bias_swiglu_fusion=false"]
MODEL_SMOKE = ["model=tiny_gpt", "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=512",
               "model.num_attention_heads=4", "model.seq_length=64", "model.attention_backend=unfused",
               "model.attention_softmax_in_fp32=true"]
CLUSTERS = {"h100_sxm": "dgx_h100_superpod", "h200": "dgx_h100_superpod", "b200": "dgx_h100_superpod",
            "a100_80gb": "dgx_a100_superpod"}


@dataclass
class Case:
    name: str
    pins: list[str]
    predicted: dict = field(default_factory=dict)
    roofline: dict = field(default_factory=dict)
    megatron_args: list[str] = field(default_factory=list)
    world: int = 1
    measured_step_s: float | None = None
    measured_peak_bytes: int | None = None
    note: str = ""
    log: str = ""  # the training's command and the end of its output, for the run's .log file


def say(message: str) -> None:
    print(f"{PREFIX}: {message}", flush=True)


def fail(message: str) -> int:
    print(f"{PREFIX}: error: {message}", file=sys.stderr, flush=True)
    return 2


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="validate_on_gpu.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="the same steps at tiny size on the CPU (no table of record)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="write the table and the profile cache into this folder (default: their places in the repo)")
    p.add_argument("--iters", type=int, default=None, help="training iterations per configuration (default 20; smoke 2)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting trainings after this many seconds")
    return p.parse_args(argv)


# --- the machine -----------------------------------------------------------------------------
def machine(smoke: bool) -> tuple[str, str, int]:
    """(accelerator config, device name, GPUs) of this machine."""
    import torch

    from nest_megatron.profile.for_plan import GPU_ACCELERATORS, accelerator_of_device

    if smoke:
        return "h100_sxm", "cpu", 1
    if not torch.cuda.is_available():
        raise SystemExit(fail("no CUDA device visible; run with --cpu-smoke for the CPU dry run"))
    name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
    accelerator = accelerator_of_device(name)
    if accelerator is None:
        raise SystemExit(fail(f"{name}: no accelerator config describes it; known: {', '.join(GPU_ACCELERATORS)}"))
    return accelerator, name, min(count, 8)


def cases(gpus: int, smoke: bool) -> list[Case]:
    """The hand-picked configurations (the planner's choice joins them later)."""
    if smoke:
        chosen = [Case("mbs1", ["plan.mbs=1", "plan.recompute=none"]),
                  Case("mbs1 selective", ["plan.mbs=1", "plan.recompute=selective"])]
    else:
        chosen = [Case("mbs1", ["plan.mbs=1", "plan.recompute=none"]),
                  Case("mbs2 selective", ["plan.mbs=2", "plan.recompute=selective"]),
                  Case("mbs2", ["plan.mbs=2", "plan.recompute=none"]),
                  Case("mbs4", ["plan.mbs=4", "plan.recompute=none"]),
                  Case("mbs4 full", ["plan.mbs=4", "plan.recompute=full"])]
    if gpus >= 2:
        chosen += [Case("tp2 mbs2", ["plan.tp=2", "plan.pp=1", "plan.mbs=2", "plan.recompute=none"]),
                   Case("pp2 mbs2", ["plan.tp=1", "plan.pp=2", "plan.mbs=2", "plan.recompute=none"])]
    for case in chosen:
        case.pins += ["plan.zero=1"] + ([] if any(p.startswith("plan.tp=") for p in case.pins) else ["plan.tp=1", "plan.pp=1"])
    return chosen


# --- steps -----------------------------------------------------------------------------------
def run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`command` in its own process group, all of which is killed at the timeout: torchrun's workers must
    not outlive it and hold the GPU while the next configuration is measured."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_profile(problem: list[str], cache: Path, smoke: bool, timeout_s: float) -> str:
    """Profile into `cache`; the end of profile's output, for the log."""
    # one warm-up run even in the smoke run: a first call pays one-time set-up (allocations, kernel selection)
    repeats = ["profile.warmup=1", "profile.repeats=1"] if smoke else ["profile.warmup=3", "profile.repeats=10"]
    command = [sys.executable, "-m", "nest_megatron.cli", "profile", *problem, *repeats, f"cache={cache}", "--quiet"]
    done = run(command, timeout_s)
    output = f"== profile: {shlex.join(command)} (exit {done.returncode})\n{tail(done.stdout + done.stderr)}\n"
    if done.returncode != 0:
        raise RuntimeError(f"nest-megatron profile failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}\n"
                           + output)
    return output


def predict(problem: list[str], priced: list[str], case: Case) -> None:
    """The case's prediction priced as `priced` says (its profile cache, or the roofline), and with the roofline."""
    from nest_megatron import api

    fitted = api.evaluate([*problem, *case.pins, *priced])
    case.predicted = fitted.predicted | {"compute": fitted.search["compute"]}
    case.roofline = api.evaluate([*problem, *case.pins, "profile.use=false"]).predicted
    case.megatron_args = fitted.megatron_args
    case.world = fitted.world_size


def planner_case(problem: list[str], priced: list[str]) -> Case:
    from nest_megatron import api

    plan = api.plan([*problem, *priced])
    p = plan.parallel
    pins = [f"plan.{k}={v}" for k, v in (("tp", p["tp"]), ("pp", p["pp"]), ("cp", p["cp"]), ("vpp", p["vpp"]),
                                          ("mbs", plan.micro_batch_size), ("zero", plan.zero_stage))]
    pins += [f"plan.recompute={plan.recompute['granularity'] or 'none'}", f"plan.order={plan.rank_order}"]
    if plan.recompute["method"] == "block":  # the first n layers of each stage (uniform, 1: every layer)
        pins.append(f"plan.recompute_num_layers={plan.recompute['num_layers']}")
    return Case("planner's choice", pins)


ITERATION = re.compile(r"iteration +(\d+)/ *\d+ \|.*? elapsed time per iteration \(ms\): ([\d.]+) \|")  # Megatron-LM's
PEAK = re.compile(rf"{PREFIX} peak_memory_bytes=(-?\d+)")


def train(case: Case, *, vocab_size: int, iters: int, timeout_s: float) -> None:
    """Run pretrain_gpt.py with the case's Megatron arguments; record the median iteration time
    after the first third of the iterations and the largest max_memory_allocated of the ranks."""
    argv = [*case.megatron_args, "--vocab-size", str(vocab_size), "--train-iters", str(iters), "--lr", "1e-4"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.world}",
               str(Path(__file__).resolve()), "--train-worker", *argv]
    done = run(command, timeout_s)
    case.log = f"== {case.name}: {shlex.join(command)} (exit {done.returncode})\n{tail(done.stdout + done.stderr)}\n"
    times = [(int(i), float(ms) / 1e3) for i, ms in ITERATION.findall(done.stdout)]
    if done.returncode != 0 or len(times) < iters:
        lines = (done.stderr + done.stdout).strip().splitlines()
        errors = [line for line in lines if "Error" in line] or lines[-1:] or ["no output"]
        case.note = f"training failed: {errors[-1].strip()[:200]}"
        return
    steady = [t for i, t in times if i > max(1, iters // 3)]
    case.measured_step_s = statistics.median(steady)
    peaks = [int(b) for b in PEAK.findall(done.stdout)]
    case.measured_peak_bytes = max(peaks) if peaks and max(peaks) >= 0 else None


def train_worker(argv: list[str]) -> int:
    """Inside torchrun: pretrain_gpt.main, then this rank's peak of allocated CUDA memory."""
    import torch

    spec = importlib.util.spec_from_file_location("pretrain_gpt", PRETRAIN)
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    code = pretrain.main(argv)
    peak = torch.cuda.max_memory_allocated(int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else -1
    print(f"{PREFIX} peak_memory_bytes={peak} rank={os.environ.get('RANK', '0')}", flush=True)
    return code


# --- the table -------------------------------------------------------------------------------
GIB = 2**30


def error(predicted: float | None, measured: float | None) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if predicted is not None and measured else "-"


def table(all_cases: list[Case]) -> str:
    lines = ["| configuration | TP | PP | DP | mbs | recompute | step predicted (profile) s | step predicted (roofline) s "
             "| step measured s | error | memory predicted GiB | peak allocated GiB | error | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in all_cases:
        args = c.megatron_args

        def flag(name, default="1"):
            return args[args.index(name) + 1] if name in args else default

        tp, pp, mbs = flag("--tensor-model-parallel-size"), flag("--pipeline-model-parallel-size"), flag("--micro-batch-size")
        recompute = flag("--recompute-granularity", "none")
        dp = c.world // (int(tp) * int(pp)) if args else "-"
        step = c.predicted.get("step_time_s")
        memory = None
        if c.predicted:
            memory = (c.predicted["peak_memory_gib"] - max(s["workspace"] for s in c.predicted["memory_breakdown_gib"]))
        measured_memory = c.measured_peak_bytes / GIB if c.measured_peak_bytes is not None else None
        lines.append(
            f"| {c.name} | {tp} | {pp} | {dp} | {mbs} | {recompute} | {fmt(step)} | {fmt(c.roofline.get('step_time_s'))} "
            f"| {fmt(c.measured_step_s)} | {error(step, c.measured_step_s)} | {fmt(memory, 2)} | {fmt(measured_memory, 2)} "
            f"| {error(memory, measured_memory)} | {c.note} |")
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(path: Path, *, device: str, gpus: int, problem: list[str], all_cases: list[Case], elapsed_s: float,
           smoke: bool, profile_error: str | None) -> None:
    import torch

    from nest_megatron.profile.timing import versions

    compute = next((c.predicted["compute"] for c in all_cases if c.predicted), "-")
    text = "\n".join([
        f"# Validation on {gpus} x {device}{' (CPU smoke run, not a record)' if smoke else ''}",
        "",
        f"Date: {datetime.date.today().isoformat()}. Command: `bash scripts/validate_on_gpu.sh"
        f"{' --cpu-smoke' if smoke else ''}`; {elapsed_s:.0f} s in all.",
        f"Versions: {json.dumps(versions())}; CUDA available: {torch.cuda.is_available()}.",
        "",
        f"Model and cluster overrides: `{' '.join(problem)}`.",
        "",
        f"Compute model: {compute}." + (f" Profiling failed: {profile_error}." if profile_error else ""),
        "",
        "Step: the median iteration time of scripts/pretrain_gpt.py after its first third of iterations, against "
        "nest-megatron's predicted step time with the compute model fitted from this run's profile and with the "
        "shipped roofline. Memory: the largest torch.cuda.max_memory_allocated of the ranks, against the predicted "
        "peak less the workspace allowance (CUDA context, NCCL, fragmentation), which the allocator does not count.",
        "",
        table(all_cases),
        "",
    ])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--train-worker"]:
        return train_worker(argv[1:])
    args = parse_args(argv)
    start = time.monotonic()
    if not PRETRAIN.exists():
        return fail(f"{PRETRAIN} is missing: it is the megatron-core training entry this script runs")
    missing = [name for name in ("torch", "megatron.core", "hydra", "numba") if not importable(name)]
    if missing:
        return fail(f"{', '.join(missing)} not importable by {sys.executable}; install them, or on a node with no network "
                    "pass --wheels DIR made by scripts/offline_wheels.sh")
    if args.cpu_smoke and args.out_dir is None:  # its table and profile are no record: keep them out of the repo
        return fail("--cpu-smoke needs --out-dir DIR for its table and profile")
    accelerator, device, gpus = machine(args.cpu_smoke)
    iters = args.iters or (2 if args.cpu_smoke else 20)
    model = MODEL_SMOKE if args.cpu_smoke else MODEL_1B
    gbs = 2 if args.cpu_smoke else 8 * gpus
    # pretrain_gpt.py trains with DDP or the distributed optimizer (ZeRO 0 / 1), not Megatron-FSDP, and without
    # sequence parallel: the local spec's torch norm refuses it without Apex (megatron/core/transformer/torch_norm.py).
    problem = [*model, f"cluster={CLUSTERS[accelerator]}", f"accelerator={accelerator}", f"cluster.num_devices={gpus}",
               f"train.global_batch_size={gbs}", f"solver.micro_batch_sizes={'[1]' if args.cpu_smoke else '[1,2,4]'}",
               "solver.zero_stages=[0,1]", "plan.sp=false", *(["profile.allow_cpu=true"] if args.cpu_smoke else [])]
    tag = "cpu-smoke" if args.cpu_smoke else accelerator
    day = datetime.date.today().isoformat()
    if args.out_dir is None:
        out, shipped = ROOT / "docs" / "validation" / f"{day}_{tag}.md", ROOT / "nest_megatron" / "profile" / "shipped" / f"{tag}.json"
    else:
        out, shipped = args.out_dir / f"{day}_{tag}.md", args.out_dir / f"{tag}.json"
    shipped.parent.mkdir(parents=True, exist_ok=True)
    cache = shipped.with_name(f".{tag}.profiling.json")
    cache.unlink(missing_ok=True)

    say(f"profiling on {gpus} x {device}")
    profile_error = None
    try:
        profile_log = run_profile(problem, cache, args.cpu_smoke, timeout_s=args.budget_s / 2)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        # The trainings still measure the roofline's predictions: a failed profile must not waste the GPU time.
        if isinstance(err, subprocess.TimeoutExpired):
            profile_error = f"nest-megatron profile did not finish in {err.timeout:.0f} s"
            profile_log = f"== profile: {profile_error}\n"
        else:
            profile_error, profile_log = str(err).splitlines()[0], str(err).partition("\n")[2]
        say(f"{profile_error}; predicting with the roofline alone")
    priced = [f"cache={cache}"] if profile_error is None else ["profile.use=false"]
    say("planning")
    try:
        chosen = planner_case(problem, priced)
    except Exception as err:  # no configuration fits: the hand-picked ones still say how good the model is
        chosen = Case("planner's choice", [], note=f"not planned: {str(err).splitlines()[0][:200]}")
    all_cases = []
    for case in [*cases(gpus, args.cpu_smoke), chosen]:
        if not case.pins:
            all_cases.append(case)
            continue
        try:
            predict(problem, priced, case)
        except Exception as err:  # a configuration that does not fit or is invalid here: say so in the table
            case.note = f"not predicted: {str(err).splitlines()[0][:200]}"
        same = next((c for c in all_cases if c.megatron_args and c.megatron_args == case.megatron_args), None)
        if same:  # the planner chose one of the hand-picked configurations
            same.name += f" = {case.name}"
        else:
            all_cases.append(case)
    from nest_megatron.config.load import load

    vocab = load(problem).config.model.vocab_size
    for case in all_cases:
        if not case.megatron_args:
            continue
        left = args.budget_s - (time.monotonic() - start)
        if left < 20:
            case.note = "not run: time budget spent"
            continue
        say(f"training {case.name} on {case.world} process(es)")
        try:
            train(case, vocab_size=vocab, iters=iters, timeout_s=left)
        except subprocess.TimeoutExpired:
            case.note = "not run to the end: time budget spent"
    elapsed = time.monotonic() - start
    report(out, device=device, gpus=gpus, problem=problem, all_cases=all_cases, elapsed_s=elapsed, smoke=args.cpu_smoke,
           profile_error=profile_error)
    out.with_suffix(".log").write_text(profile_log + "".join(case.log for case in all_cases))
    if profile_error is None:
        shutil.move(cache, shipped)
    else:  # a partial cache is no profile to ship
        cache.unlink(missing_ok=True)
    say(f"table written to {out}, the runs' output to {out.with_suffix('.log')}"
        + (f"; profile cache to {shipped}" if profile_error is None else "") + f" ({elapsed:.0f} s)")
    print(table(all_cases))
    failed = any(c.note.startswith(("training failed", "not predicted", "not planned")) for c in all_cases)
    return 1 if failed or profile_error else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
