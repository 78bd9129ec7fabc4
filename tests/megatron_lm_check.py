"""Run Megatron-LM's own argument checks on argvs: `python megatron_lm_check.py CASES.json` (run by
tests/test_megatron_lm_validation.py in a fresh process, because the checkout's megatron.core must not
mix with the installed megatron-core wheel of the other tests).

For each case {"name", "argv", "world_size", "env"}: megatron.training.arguments.parse_args() and
validate_args() with WORLD_SIZE / RANK set as torchrun sets them, then megatron-core's
initialize_model_parallel() at that world size on torch's "fake" process-group backend (a stand-in for
world_size real GPUs: it builds every group without communicating). Prints one JSON object:
{"commit": ..., "results": {name: null | "the first error"}}.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import typing
from contextlib import redirect_stdout

ROOT = os.environ["MEGATRON_LM_ROOT"]
sys.path.insert(0, ROOT)

# Megatron-LM main declares Python >= 3.12; the only 3.12 feature its argument code reaches is
# typing.override (a no-op decorator), so 3.11 gets the same no-op.
if not hasattr(typing, "override"):
    typing.override = lambda f: f

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training import arguments  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

# No GPU here: validate_args asks the device's architecture to choose its CUDA_DEVICE_MAX_CONNECTIONS
# rule and --moe-grouped-gemm its compute capability; answer as an H100 (sm 90, the paper grid's GPU) would.
arguments.get_device_arch_version = lambda: 9
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # --moe-grouped-gemm asks it (arguments.py:1379)


def validate(argv: list[str], world_size: int, env: dict[str, str | None]) -> None:
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0")
    for key, value in env.items():  # the environment the launcher gives torchrun
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.argv = ["pretrain_gpt.py", *argv]
    with redirect_stdout(io.StringIO()):  # validate_args prints every argument on rank 0
        args = arguments.parse_args()
        arguments.validate_args(args)
    # As megatron/training/initialize.py calls it, on the fake backend; CPU gloo groups are not needed.
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
            create_gloo_process_groups=False,
        )
        assert parallel_state.get_data_parallel_world_size() == args.data_parallel_size
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    results = {}
    for case in cases:
        try:
            validate(case["argv"], case["world_size"], case.get("env", {}))
            results[case["name"]] = None
        except (AssertionError, ValueError, RuntimeError, SystemExit, TypeError, KeyError) as err:
            results[case["name"]] = f"{type(err).__name__}: {err}".splitlines()[0][:400]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit or os.environ.get("MEGATRON_LM_COMMIT", "unknown"), "torch": torch.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()
