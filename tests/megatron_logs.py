"""Training logs as Megatron-LM and Megatron-Bridge print them, for the calibration tests: each function uses the
framework's own format strings, at the commit and line cited (tests/test_calibration.py checks, where a checkout is
at hand, that every string is in that source verbatim).

Megatron-LM d98e8a6:
- megatron/training/arguments.py:1990-2001 `_print_args`
- megatron/training/training.py:3567-3641 `training_log` (the stdout line)
- megatron/training/utils/common_utils.py:313-334 `report_memory`
- megatron/training/vocab_utils.py:35-39 `calculate_padded_vocab_size`
NeMo 8cfedd7 (NeMo 2):
- nemo/lightning/pytorch/callbacks/progress_printer.py:42,55-63,141-144 (`MegatronProgressBar`)
Megatron-Bridge 067f987:
- src/megatron/bridge/training/utils/train_utils.py:1088-1148 `training_log`
- src/megatron/bridge/training/config.py:1846-1875 `ConfigContainer.log_non_default_values`
- src/megatron/bridge/training/initialize.py:785
"""

from __future__ import annotations

# The format strings, as written in the sources above (checked by test_format_strings_are_megatron_lms).
MEGATRON_LM_STRINGS = {
    "megatron/training/arguments.py": [
        "print(f'------------------------ {title} ------------------------', flush=True)",
        "dots = '.' * (48 - len(arg))",
        "str_list.append('  {} {} {}'.format(arg, dots, getattr(args, arg)))",
        "for arg in sorted(str_list, key=lambda x: x.lower()):",
        "print(f'-------------------- end of {title} ---------------------', flush=True)",
    ],
    "megatron/training/training.py": [
        "log_string = f\" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]\"",
        "log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)",
        "log_string += ' consumed samples: {:12d} |'.format(args.consumed_train_samples)",
        "log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(",
        "log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'",
        "log_string += f' learning rate: {learning_rate:.6E} |'",
        "log_string += f' global batch size: {batch_size:5d} |'",
        "log_string += ' {}: {:.6E} |'.format(key, avg)",
        "log_string += f' loss scale: {loss_scale:.1f} |'",
        "log_string += f' grad norm: {grad_norm:.3f} |'",
        "log_string += ' number of skipped iterations: {:3d} |'.format(",
        "log_string += ' number of nan iterations: {:3d} |'.format(total_loss_dict[nan_iters_key])",
    ],
    "megatron/training/utils/common_utils.py": [
        "string = name + ' memory (MB)'",
        'string += f" | allocated: {torch.cuda.memory_allocated() / mega_bytes:.2f}"',
        'string += f" | max allocated: {torch.cuda.max_memory_allocated() / mega_bytes:.2f}"',
        'string += f" | reserved: {torch.cuda.memory_reserved() / mega_bytes:.2f}"',
        'string += f" | max reserved: {torch.cuda.max_memory_reserved() / mega_bytes:.2f}"',
        'print("[Rank {}] {}".format(torch.distributed.get_rank(), string), flush=True)',
    ],
    "megatron/training/vocab_utils.py": [
        '" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(',
    ],
}
BRIDGE_STRINGS = {
    "src/megatron/bridge/training/utils/train_utils.py": [
        "log_string = f\" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]\"",
        'log_string += " iteration {:8d}/{:8d} |".format(iteration, train_config.train_iters)',
        'log_string += " consumed samples: {:12d} |".format(global_state.train_state.consumed_train_samples)',
        'log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_time_per_iteration * 1000.0)',
        'log_string += f" throughput per GPU (TFLOP/s/GPU): {per_gpu_tf:.1f} |"',
        'log_string += f" learning rate: {learning_rate:.6E} |"',
        'log_string += f" global batch size: {batch_size:5d} |"',
        'memory_string = f"(after {iteration} iterations) memory (GB)"',
    ],
    "src/megatron/bridge/training/config.py": [
        'log_lines.append("Configuration Summary (Non-Default Values vs Megatron Core)")',
        'log_lines.append(f"\\n[{config_name}] Non-default values (vs Mcore {mcore_class.__name__}):")',
        'log_lines.append(f"  {field_name}: {current_val!r}  (Mcore default: {default_val!r})")',
        'log_lines.append(f"\\n[{config_name}]:")',
        'log_lines.append(f"  {field_name}: {value!r}")',
    ],
    "src/megatron/bridge/training/initialize.py": [
        'print(f"> initialized HyperCommGrid with tp={tp}, pp={pp}, cp={cp}, dp={dp}")',
    ],
}
NEMO_STRINGS = {
    "nemo/lightning/pytorch/callbacks/progress_printer.py": [
        'self._train_description = "Training"',
        "log_string += f' | {metric}: {val}'",
        "log_string += f' | {metric}: {val:.4}'",
        'prefix = self.train_description + f" epoch {trainer.current_epoch}, iteration {n-1}/{self.total-1}"',
    ],
}
STAMP = "2026-11-30 10:00:00.000000"  # datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f') of a fixed moment


def arguments_block(namespace: dict, title: str = "arguments") -> list[str]:
    """megatron/training/arguments.py:1990-2001, with print() turned into returned lines."""
    lines = [f'------------------------ {title} ------------------------']
    str_list = []
    for arg in namespace:
        dots = '.' * (48 - len(arg))
        str_list.append('  {} {} {}'.format(arg, dots, namespace[arg]))
    for arg in sorted(str_list, key=lambda x: x.lower()):
        lines.append(arg)
    lines.append(f'-------------------- end of {title} ---------------------')
    return lines


def iteration_line(*, iteration: int, train_iters: int, consumed: int, elapsed_s: float, batch_size: int,
                   loss: float = 2.5, throughput: float | None = None, stamp: str = STAMP) -> str:
    """megatron/training/training.py:3567-3641 (no skipped samples, energy or MoE terms)."""
    log_string = f" [{stamp}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(consumed)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_s * 1000.0)
    if throughput is not None:
        log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'
    log_string += f' learning rate: {1.5e-4:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    log_string += ' {}: {:.6E} |'.format("lm loss", loss)
    log_string += f' loss scale: {1.0:.1f} |'
    log_string += f' grad norm: {1.234:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(0)
    log_string += ' number of nan iterations: {:3d} |'.format(0)
    return log_string


def memory_line(*, rank: int, iteration: int, max_allocated_mb: float) -> str:
    """megatron/training/utils/common_utils.py:322-334 (report_memory), with the allocator's numbers given."""
    string = f"(after {iteration} iterations)" + ' memory (MB)'
    string += f" | allocated: {0.8 * max_allocated_mb:.2f}"
    string += f" | max allocated: {max_allocated_mb:.2f}"
    string += f" | reserved: {1.05 * max_allocated_mb:.2f}"
    string += f" | max reserved: {1.05 * max_allocated_mb:.2f}"
    return "[Rank {}] {}".format(rank, string)


def padded_vocab_line(vocab_size: int, padded_size: int) -> str:
    """megatron/training/vocab_utils.py:35-39."""
    return " > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
        vocab_size, padded_size - vocab_size, padded_size)


def bridge_iteration_line(*, iteration: int, train_iters: int, consumed: int, elapsed_s: float, batch_size: int,
                          throughput: float | None = None) -> str:
    """src/megatron/bridge/training/utils/train_utils.py:1088-1139 (no energy monitor, no max attention logit)."""
    log_string = f" [{STAMP[:19]}]"
    log_string += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    log_string += " consumed samples: {:12d} |".format(consumed)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_s * 1000.0)
    if throughput is not None:
        log_string += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    log_string += f" learning rate: {1.5e-4:.6E} |"
    log_string += f" global batch size: {batch_size:5d} |"
    log_string += " {}: {:.6E} |".format("lm loss", 2.5)
    log_string += f" loss scale: {1.0:.1f} |"
    log_string += " number of skipped iterations: {:3d} |".format(0)
    log_string += " number of nan iterations: {:3d} |".format(0)
    return log_string


def bridge_summary(mcore: dict[str, dict[str, tuple]], other: dict[str, dict]) -> list[str]:
    """src/megatron/bridge/training/config.py:1846-1875: `mcore` maps a section ("model", "ddp", "optimizer") to
    {field: (value, Mcore default)} with the Mcore class's name under "__class__"; `other` a section to {field:
    value}."""
    log_lines = [""]
    log_lines.append("=" * 70)
    log_lines.append("Configuration Summary (Non-Default Values vs Megatron Core)")
    log_lines.append("=" * 70)
    for config_name, non_defaults in mcore.items():
        mcore_class = non_defaults.pop("__class__")
        log_lines.append(f"\n[{config_name}] Non-default values (vs Mcore {mcore_class}):")
        for field_name, (current_val, default_val) in sorted(non_defaults.items()):
            log_lines.append(f"  {field_name}: {current_val!r}  (Mcore default: {default_val!r})")
    log_lines.append("\n" + "-" * 70)
    log_lines.append("Other Configuration Values:")
    log_lines.append("-" * 70)
    for config_name, key_values in other.items():
        log_lines.append(f"\n[{config_name}]:")
        for field_name, value in sorted(key_values.items()):
            log_lines.append(f"  {field_name}: {value!r}")
    log_lines.append("\n" + "=" * 70)
    return "\n".join(log_lines).split("\n")  # print_rank_0 of the joined lines


def bridge_grid(*, tp: int, pp: int, cp: int, dp: int) -> str:
    """src/megatron/bridge/training/initialize.py:785."""
    return f"> initialized HyperCommGrid with tp={tp}, pp={pp}, cp={cp}, dp={dp}"


def nemo2_step_line(*, epoch: int, n: int, total: int, metrics: dict) -> str:
    """nemo/lightning/pytorch/callbacks/progress_printer.py:141-142 (the prefix) and :55-63 (format_string)."""
    log_string = "Training" + f" epoch {epoch}, iteration {n-1}/{total-1}"
    for metric, val in metrics.items():
        if isinstance(val, (float)) and val.is_integer():
            val = int(val)
            log_string += f' | {metric}: {val}'
        else:
            log_string += f' | {metric}: {val:.4}'
    return log_string
