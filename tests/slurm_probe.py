"""Training entry of the SLURM tests: record where this rank runs, then train with scripts/pretrain_gpt.py.

The two test "nodes" share one host name, so scripts/pretrain_gpt.py's own record cannot tell them apart;
SLURM's SLURMD_NODENAME (inherited by the torchrun agent and its workers) can. NEST_PROBE_EXIT=CODE makes
global rank 1 exit with CODE instead of training: a training that fails, to follow its exit status.
NEST_PROBE_ONLY=1 stops every rank after its record: the torchrun agents' rendezvous (which gives the node
ranks) has happened by then, and no rank pays for importing megatron-core.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

PRETRAIN = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_gpt.py"

record = {key: os.environ.get(key) for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "SLURMD_NODENAME",
                                                "SLURM_NODEID", "SLURM_JOB_NODELIST", "CUDA_VISIBLE_DEVICES")}
out = Path(os.environ["NEST_PROBE_DIR"])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{record['RANK']}.json").write_text(json.dumps(record))

if os.environ.get("NEST_PROBE_EXIT") and record["RANK"] == "1":
    sys.exit(int(os.environ["NEST_PROBE_EXIT"]))
if os.environ.get("NEST_PROBE_ONLY"):
    sys.exit(0)
sys.argv[0] = str(PRETRAIN)
runpy.run_path(str(PRETRAIN), run_name="__main__")
