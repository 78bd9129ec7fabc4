"""`nest-megatron profile [overrides] [cache=PATH]`: time the model's layers and ops under every
sub-graph strategy the planner searches, on the local devices, into the profile cache; fit the
compute model from it and show measured against predicted."""

from __future__ import annotations

import argparse

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nest_megatron.commands.common import check_writable, fail, stdout_console
from nest_megatron.config.load import load
from nest_megatron.errors import NestError
from nest_megatron.profile.for_plan import accelerator_of_device

HELP = "time layers and ops on the local devices into the profile cache that plan uses"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=llama3_8b profile.repeats=20 cache=PATH ...")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no table")


def local_setup(accelerator: str, local_devices: int | None) -> tuple[str, int, str | None]:
    """(device name, devices a group may span, a note to print) for this machine; NestError when
    the machine is not what the config says."""
    import torch

    if not torch.cuda.is_available():
        note = (f"no GPU: timing on the CPU; these profiles will not price plans for accelerator={accelerator} "
                "unless profile.allow_cpu=true")
        return "cpu", local_devices or 1, note
    name, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
    detected = accelerator_of_device(name)
    if detected and detected != accelerator:
        raise NestError(f"accelerator={accelerator}: this machine has {name}; profile it as accelerator={detected}")
    if local_devices is not None and local_devices > count:
        raise NestError(f"profile.local_devices={local_devices}: this machine has {count} GPUs")
    return name, local_devices or count, None


def run(args: argparse.Namespace) -> int:
    console = stdout_console()
    try:
        loaded = load(args.overrides)
        cfg, problem = loaded.config, loaded.problem
        from nest_megatron.profile.cache import Cache, cache_path
        from nest_megatron.profile.fit import fit
        from nest_megatron.profile.runner import plan_tasks, run_tasks, strategies

        check_writable(cache_path(cfg.cache), "cache")  # before the profiling run, not after it
        cache = Cache.load(cache_path(cfg.cache))
        device, local_devices, note = local_setup(problem.accelerator.name, cfg.profile.local_devices)
        found = strategies(problem, cfg.solver, cfg.plan, micro_batch_size=cfg.train.micro_batch_size)
        tasks = plan_tasks(problem, found, local_devices=local_devices, layers=cfg.profile.layers)
        if note and not args.quiet:
            console.print(note, highlight=False, soft_wrap=True)
        skipped = []
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=args.quiet, transient=True) as bar:
            job = bar.add_task(f"profiling {cfg.model.name} on {device}", total=len(tasks))

            def progress(task, reason):
                if reason:
                    skipped.append(f"{task.kind} {task.strategy}: {reason}")
                bar.update(job, advance=1, description=f"profiling {cfg.model.name} on {device}: {task.kind}")

            entries = run_tasks(tasks, accelerator=problem.accelerator.name, warmup=cfg.profile.warmup,
                                repeats=cfg.profile.repeats, progress=progress)
        for entry in entries:
            cache.add(entry)
        cache.save()
        result = fit(cache.select(accelerator=problem.accelerator.name), problem.accelerator)
    except (NestError, OSError) as e:
        return fail("profile", e)
    except ImportError as e:
        return fail("profile", f"profiling needs torch and megatron-core ({e}); pip install 'nest-megatron[megatron]'")
    if not args.quiet:
        console.print(layer_table(entries, result.compute))
        for line in skipped:
            console.print(f"not timed: {line}", highlight=False, soft_wrap=True)
        console.print(f"{len(entries)} measurements written to {cache.path}", highlight=False, soft_wrap=True)
        console.print(f"compute model for {problem.accelerator.name}: {result.summary()}", highlight=False, soft_wrap=True)
    return 0


def layer_table(entries, compute) -> Table:
    """Measured layer times against the fitted model's (forward + backward, ms)."""
    from nest_megatron.profile.fit import layer_time_of

    table = Table(title="layers: forward + backward of one micro-batch, ms",
                  caption="one rank: the shard timed alone plus the modelled collectives (comm)")
    for column in ("layer", "strategy", "timed as", "measured", "comm", "fitted model"):
        table.add_column(column, justify="right")
    for e in entries:
        if e.kind not in ("dense", "moe", "embedding", "output"):
            continue
        strategy = " ".join(k if v is True else f"{k}{v}" for k, v in e.strategy.items()
                            if v is True or (not isinstance(v, bool) and (v != 1 or k in ("tp", "mbs"))))
        measured = e.seconds + (0.0 if e.includes_comm else e.modelled_comm_s)
        model = layer_time_of(e, compute) + e.modelled_comm_s if e.kind in ("dense", "moe") else None
        table.add_row(e.kind, strategy, "processes" if e.includes_comm else "one rank", f"{measured * 1e3:.3f}",
                      f"{e.modelled_comm_s * 1e3:.3f}", f"{model * 1e3:.3f}" if model is not None else "-")
    return table
