"""Time `plan` for one cell (default: the README's Llama 3 70B / 1,024-GPU cell) and print the
search statistics. Usage: python scripts/time_plan.py [overrides...]"""

import platform
import sys
import time

from nest_megatron import api

overrides = sys.argv[1:] or ["model=llama3_70b", "cluster=h100_spine_leaf", "cluster.num_devices=1024",
                             "train.global_batch_size=4096"]
start = time.perf_counter()
plan = api.plan(overrides)
wall = time.perf_counter() - start
print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
print(f"overrides: {' '.join(overrides)}")
print(f"wall {wall:.2f} s (search {plan.search['time_s']:.2f} s, {plan.search['configs_evaluated']} configurations)")
p = plan.parallel
print(f"plan: tp={p['tp']} pp={p['pp']} dp={p['dp']} cp={p['cp']} vpp={p['vpp']} mbs={plan.micro_batch_size} "
      f"zero={plan.zero_stage} recompute={plan.recompute['granularity']} "
      f"step {plan.predicted['step_time_s']:.3f} s, MFU {plan.predicted['mfu']:.1%}, "
      f"peak {plan.predicted['peak_memory_gib']:.1f} GiB")
