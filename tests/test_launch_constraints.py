"""The user's settings are constraints unless they say otherwise (launch/constraints.py, launch/changes.py):
a resume keeps the checkpoint's format and optimizer family, --tp-comm-overlap comes only with sequence parallel,
every flag the plan changes is listed on stderr with why, and what no plan satisfies is one line, exit 2."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from nest_megatron import api, cli
from nest_megatron.commands.launch import torchrun_main
from nest_megatron.config.load import load
from nest_megatron.errors import InfeasibleError, NestError
from nest_megatron.launch.constraints import argv_constraints
from nest_megatron.launch.prepare import problem_overrides
from nest_megatron.report.table import render

# A 7B-like dense model: 32 layers of 4096, 32 heads; planned on 2 DGX H100 nodes (16 GPUs) in about a second.
MODEL = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
         "--vocab-size 32000 --swiglu --normalization RMSNorm --disable-bias-linear --bf16 --global-batch-size 256 "
         "--micro-batch-size 1").split()
NODES = ["cluster=dgx_h100_superpod", "--nnodes", "2", "--nproc-per-node", "8", "--master-addr", "n1"]
# The same problem as Hydra overrides, for pricing layouts through the API (what the launch reads from MODEL).
PROBLEM = [*problem_overrides("pretrain_gpt.py", MODEL, ["cluster=dgx_h100_superpod"]), "cluster.num_devices=16"]


def dry_run(capsys, *args: str) -> tuple[list[str], list[str]]:
    """launch --dry-run through the CLI: (the final Megatron argv of node rank 0, the stderr lines)."""
    status = cli.main(["launch", *NODES, "--dry-run", *args])
    out, err = capsys.readouterr()
    assert status == 0, err
    command = next(line for line in out.splitlines() if " torchrun " in line)
    argv = shlex.split(command)
    return argv[argv.index("pretrain_gpt.py") + 1:], err.splitlines()


def value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# -- a resume keeps the checkpoint's format and the optimizer that wrote it -----------------------------------

def test_a_distributed_optimizer_resume_keeps_its_format_optimizer_and_sizes(capsys):
    """Reproduced: `--use-distributed-optimizer --ckpt-format torch_dist --load` was rewritten to Megatron-FSDP and
    fsdp_dtensor, which cannot read the checkpoint. The distributed optimizer saves its state by DP-rank bucket
    (dp_reshardable), which Megatron refuses to load at another TP or PP: those stay 8 and 1 as typed."""
    argv, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--tensor-model-parallel-size", "8",
                      "--use-distributed-optimizer", "--ckpt-format", "torch_dist", "--load", "/ckpt")
    assert value(argv, "--ckpt-format") == "torch_dist" and argv.count("--ckpt-format") == 1
    assert "--use-distributed-optimizer" in argv and "--use-megatron-fsdp" not in argv
    assert value(argv, "--tensor-model-parallel-size") == "8"
    assert value(argv, "--pipeline-model-parallel-size") == "1"
    assert value(argv, "--load") == "/ckpt"


def test_a_ddp_resume_stays_on_ddp_and_may_reshard(capsys):
    """--load without --ckpt-format reads torch_dist (Megatron's default): DDP's state is saved by model tensor, so
    the sizes may change (the unconstrained plan of this model is TP 1 under Megatron-FSDP), the optimizer not."""
    argv, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--tensor-model-parallel-size", "8", "--load", "/ckpt")
    assert not {"--use-distributed-optimizer", "--use-megatron-fsdp", "--ckpt-format"} & set(argv)
    assert value(argv, "--tensor-model-parallel-size") != "8"


def test_a_legacy_resume_keeps_every_size_in_its_files_and_the_even_split(capsys):
    """A `torch` checkpoint is a file per (TP, PP) rank and does not reshard; Megatron splits layers evenly."""
    argv, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2", "--ckpt-format", "torch", "--load", "/ckpt")
    assert (value(argv, "--tensor-model-parallel-size"), value(argv, "--pipeline-model-parallel-size")) == ("2", "2")
    assert not {"--use-distributed-optimizer", "--use-megatron-fsdp", "--pipeline-model-parallel-layout",
                "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"} & set(argv)
    assert value(argv, "--ckpt-format") == "torch"


def test_an_fsdp_resume_stays_on_megatron_fsdp(capsys):
    argv, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                      "--load", "/ckpt", "plan.tp=2")
    assert "--use-megatron-fsdp" in argv and value(argv, "--ckpt-format") == "fsdp_dtensor"


@pytest.fixture(scope="module")
def model():
    return load(["model=llama3_8b"]).config.model  # 32 layers, 32 heads, dense: the pins below stand alone


@pytest.mark.parametrize("argv, user, expected", [
    ([], [], []),  # no checkpoint, no overlap: nothing fixed
    (["--load", "/c"], [], [["plan.zero=0"]]),  # torch_dist by default, DDP
    (["--load=/c", "--use-distributed-optimizer", "--tensor-model-parallel-size", "4"], [],
     [["plan.zero=1", "plan.tp=4", "plan.pp=1", "plan.vpp=1", "plan.ep=1", "plan.etp=1"]]),
    (["--load=/c", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "4"], [],  # and the even split
     [["plan.zero=1", "plan.tp=1", "plan.pp=4", "plan.vpp=1", "plan.ep=1", "plan.etp=1", "plan.layers_per_stage=[8,8,8,8]"]]),
    (["--load", "/c", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"], [], [["plan.zero=1"]]),
    (["--load", "/c", "--use-distributed-optimizer", "--no-load-optim"], [], [["solver.zero_stages=[0,1]"]]),
    (["--load", "/c", "--use-distributed-optimizer", "--finetune"], [], [["solver.zero_stages=[0,1]"]]),
    (["--ckpt-format", "fsdp_dtensor"], [], [["solver.zero_stages=[2,3]"]]),  # --save's format: the next resume's
    (["--load", "/c", "--ckpt-format", "torch", "--pipeline-model-parallel-size", "2"], [],
     [["plan.tp=1", "plan.pp=2", "plan.vpp=1", "plan.ep=1", "plan.etp=1", "plan.zero=0", "plan.layers_per_stage=[16,16]"]]),
    # a split of the argv's own is kept as the same flags' plan.* keys
    (["--load", "/c", "--ckpt-format", "torch", "--pipeline-model-parallel-size", "2",
      "--decoder-first-pipeline-num-layers", "15"], [],
     [["plan.tp=1", "plan.pp=2", "plan.vpp=1", "plan.ep=1", "plan.etp=1", "plan.zero=0",
       "plan.decoder_first_pipeline_num_layers=15"]]),
    (["--load", "/c", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Et*15|t*17L"], [],
     [["plan.zero=1", "plan.tp=1", "plan.pp=2", "plan.vpp=1", "plan.ep=1", "plan.etp=1",
       "plan.pipeline_model_parallel_layout=Et*15|t*17L"]]),
    # the user's own overrides win: ZeRO by either key, a size by its plan.* key
    (["--load", "/c"], ["plan.zero=3"], []),
    (["--load", "/c"], ["solver.zero_stages=[0,1,2,3]"], []),
    (["--load", "/c", "--use-distributed-optimizer"], ["plan.tp=2", "plan.zero=1"],
     [["plan.pp=1", "plan.vpp=1", "plan.ep=1", "plan.etp=1"]]),
    # --tp-comm-overlap is no constraint: train.tp_comm_overlap=true (train_overrides), and the plan's own flag
    (["--tp-comm-overlap"], [], []),
    (["--tp-comm-overlap"], ["plan.sp=true"], []),
    # --fp8-param-gather needs a sharded optimizer (arguments.py:1095-1097): ZeRO 1-3, within the user's stages
    (["--fp8-param-gather"], [], [["solver.zero_stages=[1,2,3]"]]),
    (["--fp8-param-gather"], ["solver.zero_stages=[0,1]"], [["solver.zero_stages=[1]"]]),
    (["--fp8-param-gather", "--load", "/c", "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"], [],
     [["plan.zero=1"], ["solver.zero_stages=[1,2,3]"]]),
    # an optimizer Megatron-FSDP does not take (arguments.py:1150-1151, 1739-1741): ZeRO 0 or 1, with the others' stages
    (["--optimizer", "muon"], [], [["solver.zero_stages=[0,1]"]]),
    (["--optimizer", "adam"], [], []),
    (["--optimizer", "muon", "--fp8-param-gather"], [], [["solver.zero_stages=[1,2,3]"], ["solver.zero_stages=[1]"]]),
    (["--optimizer", "lion", "--load", "/c"], [], [["plan.zero=0"], ["solver.zero_stages=[0]"]]),
    # CUDA graphs (transformer_config.py:2854-2858, 2868-2884): per-layer ones take no full recompute; whole-layer ones
    # no selective recompute (core_attn in every searched set) with attention dropout, Megatron's default 0.1
    (["--cuda-graph-impl", "transformer_engine", "--attention-dropout", "0"], [], [["solver.recompute=[none,selective]"]]),
    (["--cuda-graph-impl", "local", "--cuda-graph-modules", "attn"], [], [["solver.recompute=[none,selective]"]]),
    (["--external-cuda-graph"], [], [["solver.recompute=[none]"]]),
    (["--cuda-graph-impl", "full_iteration"], [], [["solver.recompute=[none,full]"]]),
    (["--cuda-graph-impl", "full_iteration", "--attention-dropout", "0"], [], []),
    (["--cuda-graph-impl", "local", "--attention-dropout", "0"], ["solver.recompute=[selective,full]"],
     [["solver.recompute=[selective]"]]),
    # CPU offloading: megatron-core has none under pipeline parallelism or recompute (transformer_config.py:1891-1899)
    (["--cpu-offloading-num-layers", "4"], [],
     [["plan.cpu_offloading_num_layers=4", "plan.pp=1", "plan.recompute=none"]]),
    (["--cpu-offloading-num-layers", "4"], ["plan.recompute=none"], [["plan.cpu_offloading_num_layers=4", "plan.pp=1"]]),
    (["--cpu-offloading-num-layers", "0"], [], []),
])
def test_what_the_argv_fixes(model, argv, user, expected):
    assert [c.overrides for c in argv_constraints(argv, user, model=model)] == expected


@pytest.mark.parametrize("argv, user, message", [
    (["--load", "/c", "--ckpt-format", "zarr"], [], "--ckpt-format zarr: allowed are torch, torch_dist, torch_dcp, fsdp_dtensor"),
    (["--load", "/c", "--ckpt-format", "fsdp_dtensor", "--use-distributed-optimizer"], [],
     "--load with --ckpt-format fsdp_dtensor and --use-distributed-optimizer: only Megatron-FSDP"),
    (["--load", "/c", "--use-megatron-fsdp"], [], "--load with --ckpt-format torch_dist and --use-megatron-fsdp: "),
    (["--load", "/c", "--ckpt-format", "torch_dcp"], [], "--load with --ckpt-format torch_dcp: the checkpoint is torch FSDP2's"),
    (["--load", "/c", "--ckpt-format", "torch", "--tensor-model-parallel-size", "3"], [],
     "--load with --ckpt-format torch keeps the argv's sizes, but pinned --tensor-model-parallel-size 3: must divide"),
    (["--fp8-param-gather"], ["plan.zero=0"], "--fp8-param-gather needs a sharded optimizer (ZeRO 1-3: the distributed "
                                              "optimizer or Megatron-FSDP), but DDP (ZeRO 0) is fixed by your overrides"),
    (["--fp8-param-gather", "--load", "/c"], [], "--fp8-param-gather needs a sharded optimizer (ZeRO 1-3: the "
                                                 "distributed optimizer or Megatron-FSDP), but DDP (ZeRO 0) is fixed by "
                                                 "--load with --ckpt-format torch_dist (DDP)"),
    (["--optimizer", "muon"], ["plan.zero=3"], "--optimizer muon runs without Megatron-FSDP (ZeRO 0 or 1: DDP or the "
                                               "distributed optimizer), but ZeRO 3 is fixed by your overrides"),
    (["--optimizer", "soap", "--ckpt-format", "fsdp_dtensor"], [], "--optimizer soap runs without Megatron-FSDP (ZeRO 0 "
                                                                  "or 1: DDP or the distributed optimizer), but ZeRO 2,3 "
                                                                  "is fixed by --ckpt-format fsdp_dtensor (Megatron-FSDP)"),
    (["--step-batch-size-schedule", "0:64,1000:128"], [], "--step-batch-size-schedule: the plan is made for one "
                                                          "global batch and gives --global-batch-size, which "
                                                          "Megatron-LM refuses beside a schedule"),
    (["--cuda-graph-impl", "local", "--attention-dropout", "0"], ["plan.recompute=full"],
     "--cuda-graph-impl local takes recompute none or selective (megatron-core), but plan.recompute=full is fixed by "
     "your overrides"),
    (["--cpu-offloading-num-layers", "4"], ["plan.pp=2"], "--cpu-offloading-num-layers 4 needs pp 1 and no recompute "
                                                          "(megatron-core has neither with CPU offloading), but plan.pp=2 "
                                                          "is fixed by your overrides"),
    (["--cpu-offloading-num-layers", "4", "--load", "/c", "--use-distributed-optimizer", "--pipeline-model-parallel-size",
      "2"], [], "--cpu-offloading-num-layers 4 needs pp 1 and no recompute (megatron-core has neither with CPU "
                "offloading), but plan.pp=2 is fixed by --load with --ckpt-format torch_dist"),
])
def test_what_no_plan_can_keep_is_one_line(model, argv, user, message):
    with pytest.raises(NestError) as err:
        argv_constraints(argv, user, model=model)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


# -- CPU offloading: pp 1, no recompute -----------------------------------------------------------------------------

def test_cpu_offloading_keeps_the_plan_to_one_stage_without_recompute(capsys):
    """Megatron-LM would refuse --cpu-offloading-num-layers with pp > 1 or recompute at start (transformer_config.py:
    1891-1899). Under DDP (plan.zero=0) the 7B's weights, gradients and Adam state (18 B a parameter) want a split:
    the plan takes pp > 1; with the offloading it splits by TP instead, on one stage, and recomputes nothing. A pinned
    pp 4 with the offloading is one line."""
    argv, _ = dry_run(capsys, "plan.zero=0", "--", "pretrain_gpt.py", *MODEL)
    assert int(value(argv, "--pipeline-model-parallel-size")) > 1
    argv, _ = dry_run(capsys, "plan.zero=0", "--", "pretrain_gpt.py", *MODEL, "--cpu-offloading-num-layers", "4")
    assert value(argv, "--pipeline-model-parallel-size") == "1" and int(value(argv, "--tensor-model-parallel-size")) > 1
    assert "--recompute-granularity" not in argv and value(argv, "--cpu-offloading-num-layers") == "4"
    assert cli.main(["launch", *NODES, "--dry-run", "--pin", "pp", "--", "pretrain_gpt.py", *MODEL,
                     "--pipeline-model-parallel-size", "4", "--cpu-offloading-num-layers", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nest-megatron launch: error: --cpu-offloading-num-layers 4 needs pp 1 and no recompute (megatron-core has "
        "neither with CPU offloading), but plan.pp=4 is fixed by --pin pp")


# -- --tp-comm-overlap only with sequence parallel ----------------------------------------------------------------

def test_tp_comm_overlap_only_with_sequence_parallel(capsys):
    """Reproduced: re-planned to TP 1 without --sequence-parallel but with --tp-comm-overlap, which Megatron-LM
    asserts against ("overlap can happen only when sequence parallelism is enabled"); the dry run exited 0.
    The flag is train.tp_comm_overlap=true now: a TP > 1 plan has it with sequence parallel, a TP 1 plan drops it
    (listed as a change); a pinned TP 4 keeps both."""
    typed = [*MODEL, "--tensor-model-parallel-size", "4", "--sequence-parallel", "--tp-comm-overlap"]
    argv, err = dry_run(capsys, "--", "pretrain_gpt.py", *typed)
    if value(argv, "--tensor-model-parallel-size") == "1":
        assert "--tp-comm-overlap" not in argv and "--sequence-parallel" not in argv
        assert any(line.startswith("--tp-comm-overlap: on -> (removed) (") for line in err), err
    else:
        assert argv.count("--tp-comm-overlap") == 1 and "--sequence-parallel" in argv
    argv, _ = dry_run(capsys, "--pin", "tp", "--", "pretrain_gpt.py", *typed)
    assert value(argv, "--tensor-model-parallel-size") == "4"
    assert argv.count("--tp-comm-overlap") == 1 and argv.count("--sequence-parallel") == 1


# -- every change is listed, with why --------------------------------------------------------------------------

def step_time(*plan_overrides: str) -> float:
    return api.evaluate([*PROBLEM, *plan_overrides]).predicted["step_time_s"]


def test_each_changed_flag_is_one_line_with_the_cost_models_why(capsys):
    """Reproduced: an unpinned --tensor-model-parallel-size 8 became another size with no word. Each layout flag is
    explained on its own: the plan with only that flag back at the user's value, priced by the same cost model."""
    argv, err = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--tensor-model-parallel-size", "8",
                        "--use-distributed-optimizer")
    planned = api.plan([*PROBLEM])  # the same problem through the API: the plan the launch makes
    assert planned.parallel["tp"] == 1 and planned.zero_stage == 3  # what the lines below say, by the plan itself
    rest = [f"plan.mbs={planned.micro_batch_size}", "plan.pp=1", "plan.cp=1", "plan.sp=false", "plan.recompute=none",
            "plan.vpp=1", "plan.order=tp-cp-ep-dp-pp"]
    # TP 8 with the plan's other flags (Megatron-FSDP, ZeRO 3): priced as that layout
    tp8 = step_time("plan.tp=8", "plan.zero=3", *rest) / planned.predicted["step_time_s"]
    tp8_why = f"with --tensor-model-parallel-size 8 and the plan's other flags, the planned layout is {tp8:.2f}x faster by the cost model"
    # Megatron-FSDP off (its strategy and checkpoint format with it) and the rest as planned, the distributed
    # optimizer removed among them: plain DDP (ZeRO 0), which evaluate refuses as not fitting (6.5e9 parameters x 16
    # bytes = 97 GiB before activations); the launch's line gives the same figure
    with pytest.raises(InfeasibleError, match=r"needs (\d+\.\d) GiB") as refused:
        step_time("plan.tp=1", "plan.zero=0", *rest)
    zero1_gib = re.search(r"needs (\d+\.\d) GiB", str(refused.value)).group(1)
    assert err[0] == f"nest-megatron: the plan changes {len(err) - 1} flag(s) of the script's arguments:"
    listed = set(err[1:])
    assert {
        f"--tensor-model-parallel-size: 8 -> 1 ({tp8_why})",
        "--data-parallel-sharding-strategy: (unset) -> optim_grads_params (goes with --use-megatron-fsdp)",
        "--ckpt-format: (unset) -> fsdp_dtensor (Megatron-FSDP reads and writes only fsdp_dtensor)",
    } <= listed
    fsdp = next(line for line in listed if line.startswith("--use-megatron-fsdp: (unset) -> on (with "))
    assert fsdp.endswith(f"the given layout does not fit: {zero1_gib} GiB of 79.6 GiB device memory)"), fsdp
    assert len({line.split(" (", 1)[1] for line in listed}) > 2  # not one reason for all
    assert value(argv, "--tensor-model-parallel-size") == "1"


def test_a_layout_that_breaks_a_rule_says_which(capsys):
    """Reproduced: --tensor-model-parallel-size 3 --micro-batch-size 1 became another TP and micro-batch silently.
    16 ranks do not split into groups of 3."""
    _, err = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--tensor-model-parallel-size", "3")
    assert err[1] == ("--tensor-model-parallel-size: 3 -> 1 (with --tensor-model-parallel-size 3 and the plan's other "
                      "flags, the given layout breaks a Megatron rule: world size 16 is not divisible by tp*pp*cp = 3*1*1)")


def test_a_layout_that_does_not_fit_says_by_how_much(capsys):
    """32 layers of 4096 with a 32000 vocabulary: about 6.5e9 parameters, 16 bytes each under DDP with Adam (bf16
    weights and grads, fp32 master weights and two moments) = 97 GiB on one GPU of 79.6 GiB before activations."""
    _, err = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL)  # no parallel flag: TP 1, PP 1, DDP
    line = next(line for line in err if line.startswith("--use-megatron-fsdp: "))
    assert line.startswith("--use-megatron-fsdp: (unset) -> on (with --use-megatron-fsdp unset and the plan's other "
                           "flags, the given layout does not fit: ")
    need = float(line.split("does not fit: ")[1].split(" GiB")[0])
    assert need > 97 and line.endswith(" GiB of 79.6 GiB device memory)")


def test_the_plans_own_argv_changes_nothing(capsys):
    first, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL)
    again, err = dry_run(capsys, "--", "pretrain_gpt.py", *first)
    assert again == first and err == []


# -- --pin and solver.keep_user_parallelism, as README documents -------------------------------------------------

@pytest.mark.parametrize("keep", [["--pin", "tp"], ["solver.keep_user_parallelism=[tp]"]], ids=["pin", "hydra"])
def test_pinned_sizes_stay_as_typed(capsys, keep):
    argv, err = dry_run(capsys, *keep, "--", "pretrain_gpt.py", *MODEL, "--tensor-model-parallel-size", "8")
    assert value(argv, "--tensor-model-parallel-size") == "8"  # unpinned, the plan takes 1 (above)
    assert not any(line.startswith("--tensor-model-parallel-size:") for line in err)


def test_nest_torchrun_pins_too(capsys):
    assert torchrun_main(["cluster=dgx_h100_superpod", "--dry-run", "--pin", "tp,pp", "--nnodes", "2",
                          "--nproc-per-node", "8", "--node-rank", "0", "--master-addr", "n1", "pretrain_gpt.py", *MODEL,
                          "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"]) == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if " torchrun " in line)
    argv = shlex.split(command)
    assert (value(argv, "--tensor-model-parallel-size"), value(argv, "--pipeline-model-parallel-size")) == ("4", "2")


# -- what no plan satisfies: one line, exit 2, nothing started or written ---------------------------------------

def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "nest-megatron"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("args, message", [
    ([*MODEL, "--load", "/c", "--ckpt-format", "fsdp_dtensor", "--use-distributed-optimizer"],
     "--load with --ckpt-format fsdp_dtensor and --use-distributed-optimizer: only Megatron-FSDP (--use-megatron-fsdp) "
     "reads fsdp_dtensor"),
    # 80 layers of 8192 under TP 8 on one node of 8: weights and optimizer state alone are 16 B x 70e9 / 8 = 130 GiB
    (["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--seq-length", "4096",
      "--vocab-size", "32000", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
      "--tensor-model-parallel-size", "8", "--pin", "tp,pp"],
     "no plan keeps what the launch line fixes (pinned tp,pp): no configuration of t fits on 8 "),
], ids=["fsdp-and-distributed-optimizer", "pins"])
def test_what_no_plan_satisfies_is_one_line_and_starts_nothing(tmp_path, args, message):
    recorder = tmp_path / "t.py"  # a script that would leave a file behind, had torchrun started it
    recorder.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    pin = args[args.index("--pin"):args.index("--pin") + 2] if "--pin" in args else []
    megatron = [a for a in args if a not in pin]
    devices = ["--nproc-per-node", "8"]
    for dry in ([], ["--dry-run"]):
        proc = run_cli("launch", "cluster=dgx_h100_superpod", f"cluster.num_devices={devices[1]}", *devices, *pin, *dry,
                       "--", str(recorder), *megatron)
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip()
        assert "\n" not in line and line.startswith(f"nest-megatron launch: error: {message}"), line
        assert proc.stdout == "" and not (tmp_path / "started").exists()
    script = tmp_path / "job.sh"
    proc = run_cli("sbatch", "cluster=dgx_h100_superpod", "--nodes", "1", "--gpus-per-node", devices[1],
                   f"cluster.levels.0.fan_out={devices[1]}", *pin, f"out={script}", "--", str(recorder), *megatron)
    assert proc.returncode == 2 and proc.stderr.startswith(f"nest-megatron sbatch: error: {message}"), proc.stderr
    assert not script.exists()


def test_sbatch_lists_the_changes_when_it_writes_the_job(tmp_path, capsys):
    """Every node's launch will change the same flags: sbatch says which when the job is written."""
    script = tmp_path / "job.sh"
    assert cli.main(["sbatch", "cluster=dgx_h100_superpod", "--nodes", "2", f"out={script}", "--", "pretrain_gpt.py",
                     *MODEL, "--tensor-model-parallel-size", "3"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[1] == ("--tensor-model-parallel-size: 3 -> 1 (with --tensor-model-parallel-size 3 and the plan's other "
                      "flags, the given layout breaks a Megatron rule: world size 16 is not divisible by tp*pp*cp = 3*1*1)")
    assert script.exists()


# -- the EP all-to-all overlap: searched, unless the argv says -------------------------------------------------

MOE = ["model=tiny_moe", "train.global_batch_size=64"]


@pytest.mark.parametrize("flags, overlapped", [
    ([], None),  # the search decides (and the plan lists the flag as a change when it adds it)
    (["--overlap-moe-expert-parallel-comm"], True),
    (["--delay-wgrad-compute"], True),  # runs only with the overlap: the plan has both
    (["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"], True),
    (["--overlap-dispatch-backward-with-experts-wgrad"], False),  # megatron-core takes it only without the overlap
])
def test_the_argv_s_overlap_flags_hold_the_plan(capsys, flags, overlapped):
    argv, err = dry_run(capsys, *MOE, "--", "pretrain_gpt.py", "--bf16", *flags)
    if overlapped is not None:
        assert ("--overlap-moe-expert-parallel-comm" in argv) == overlapped, err
    assert ("--delay-wgrad-compute" in argv) == ("--delay-wgrad-compute" in flags)
    if "--overlap-moe-expert-parallel-comm" in argv and "--overlap-moe-expert-parallel-comm" not in flags:
        assert any(line.startswith("--overlap-moe-expert-parallel-comm: (unset) -> on") for line in err), err


def test_the_user_s_overlap_key_beats_the_argv_and_a_conflict_is_one_line(capsys):
    argv, _ = dry_run(capsys, *MOE, "plan.moe_a2a_overlap=false", "--", "pretrain_gpt.py", "--bf16",
                      "--overlap-moe-expert-parallel-comm")
    assert "--overlap-moe-expert-parallel-comm" not in argv
    status = cli.main(["launch", *NODES, "--dry-run", *MOE, "plan.moe_a2a_overlap=false", "--", "pretrain_gpt.py",
                       "--bf16", "--delay-wgrad-compute"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1
    assert "train.delay_wgrad_compute=true with plan.moe_a2a_overlap=false" in err[0]


def test_an_overlap_the_plan_adds_is_listed_with_its_gain(capsys):
    # GPT-OSS 120B's experts over four layers on the 16 GPUs: the overlap pays, and the argv did not ask for it
    argv, err = dry_run(capsys, "model=gpt_oss_120b", "model.num_layers=4", "train.global_batch_size=64", "plan.pp=1",
                        "plan.zero=1", "plan.recompute=none", "plan.mbs=1", "--", "pretrain_gpt.py", "--bf16")
    assert "--overlap-moe-expert-parallel-comm" in argv
    [line] = [line for line in err if line.startswith("--overlap-moe-expert-parallel-comm:")]
    assert re.search(r"\(unset\) -> on \(.*the planned layout is \d\.\d\dx faster by the cost model\)", line), line


# -- --defer-embedding-wgrad-compute: megatron-core takes it only with pipeline parallelism --------------------

def test_a_deferred_embedding_wgrad_keeps_the_plan_pipelined(capsys):
    """The 7B-like model plans without pipeline stages on 16 GPUs (TP 2, DP 8); with the flag the plan keeps pp > 1
    and launches the flag, and a pinned pp 1 is one line."""
    plain, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL)
    assert value(plain, "--pipeline-model-parallel-size") == "1"
    argv, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--defer-embedding-wgrad-compute")
    assert int(value(argv, "--pipeline-model-parallel-size")) > 1
    assert argv.count("--defer-embedding-wgrad-compute") == 1
    plan = api.plan([*PROBLEM, "train.defer_embedding_wgrad_compute=true"])
    assert plan.parallel["pp"] > 1 and "--defer-embedding-wgrad-compute" in plan.megatron_args
    with pytest.raises(NestError, match=r"^invalid configuration: plan.pp=1 with train.defer_embedding_wgrad_compute=true: "
                                        "megatron-core defers the output layer's weight gradient only with pipeline"):
        api.evaluate([*PROBLEM, "train.defer_embedding_wgrad_compute=true", "plan.pp=1"])


# -- --num-distributed-optimizer-instances: the sharded state's replicas ---------------------------------------

def test_optimizer_instances_are_kept_priced_and_refused_where_they_cannot_split(capsys):
    """The argv's instances are the plan's (emitted once); ZeRO-1's optimizer state, sharded over dp*cp / N ranks
    instead of dp*cp, is N times the memory; N that divides no dp*cp of 16 GPUs is one line."""
    argv, _ = dry_run(capsys, "--", "pretrain_gpt.py", *MODEL, "--use-distributed-optimizer",
                      "--num-distributed-optimizer-instances", "2")
    assert argv.count("--num-distributed-optimizer-instances") == 1
    assert value(argv, "--num-distributed-optimizer-instances") == "2"
    pins = ["plan.tp=1", "plan.pp=1", "plan.dp=16", "plan.zero=1", "plan.mbs=1"]
    one = api.evaluate([*PROBLEM, *pins])
    four = api.evaluate([*PROBLEM, *pins, "plan.distributed_optimizer_instances=4"])
    optimizer = [plan.predicted["memory_breakdown_gib"][0]["optimizer"] for plan in (one, four)]
    assert optimizer[1] == pytest.approx(4 * optimizer[0])  # 12 B a parameter over 4 ranks, not 16
    assert "--num-distributed-optimizer-instances" in four.megatron_args
    console = Console(record=True, width=300)
    render(four, console)
    assert "stage 1 in 4 instances" in console.export_text()
    status = cli.main(["launch", *NODES, "--dry-run", "--", "pretrain_gpt.py", *MODEL, "--use-distributed-optimizer",
                       "--num-distributed-optimizer-instances", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1
    assert "plan.distributed_optimizer_instances=3: must divide dp*cp" in err[0], err
