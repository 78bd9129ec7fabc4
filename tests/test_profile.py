"""Profiling: the cache, the fit of the compute model, plan's use of it, and `nest-megatron profile`
on this CPU with real megatron-core layers (two gloo processes under torchrun for TP = 2)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nest_megatron import api
from nest_megatron.cli import main
from nest_megatron.config.load import load
from nest_megatron.cost.compute import RooflineCompute
from nest_megatron.cost.evaluate import estimate, groups_and_network
from nest_megatron.cost.layer import layer_time
from nest_megatron.errors import NestError
from nest_megatron.model.kinds import LayerKind
from nest_megatron.model.spec import Gemm
from nest_megatron.parallel.config import ParallelConfig
from nest_megatron.profile import for_plan
from nest_megatron.profile.cache import Cache, Entry, default_path
from nest_megatron.profile.fit import FittedCompute, fit

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from script_module import load_module  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from nest_megatron.profile.runner import Strategy, layer_work  # noqa: E402

DENSE, MOE = LayerKind(mlp="dense"), LayerKind(mlp="moe")

ROOT = Path(__file__).resolve().parents[1]

# llama3_8b as megatron-core's local spec runs it (unfused attention), on one H100 node.
PROBLEM = ["model=llama3_8b", "model.attention_backend=unfused", "model.seq_length=2048", "cluster=dgx_h100_superpod",
           "cluster.num_devices=8",
           "train.global_batch_size=64"]
TRUE = dict(gemm_efficiency=0.61, attention_efficiency=0.37, memory_bound_efficiency=0.72)
TRUE_OVERHEADS = dict(gemm_overhead_s=7e-6, attention_overhead_s=2.1e-5, memory_overhead_s=4.4e-5)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nest_megatron.cli", *args], capture_output=True, text=True)


def one_line_error(capsys, *args: str) -> str:
    """Run the CLI in this process; it must exit 2 with one line on stderr, which is returned."""
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def entry(kind: str, seconds: float, *, shape=None, strategy=None, work=None, device="NVIDIA H100 80GB HBM3",
          accelerator="h100_sxm") -> Entry:
    return Entry(device=device, accelerator=accelerator, dtype="bf16", kind=kind, shape=shape or {},
                 strategy=strategy or {}, seconds=seconds, work=work or {})


def synthetic_entries(problem, compute: FittedCompute) -> list[Entry]:
    """What a profile of llama3_8b would record if the device ran exactly as `compute` says: the
    op timings from its three methods, the layer timings from the cost model's own layer_time."""
    model = problem.model
    entries = []
    for tokens in (256, 2048, 8192):  # 256: small GEMMs, where the overhead and the memory branch matter
        for tp in (1, 2, 4, 8):
            for g in model.layer_gemms(tokens=tokens, tp=tp):
                entries.append(entry("gemm", compute.gemm_time(g), shape={"m": g.m, "n": g.n, "k": g.k}))
            numel = tokens * model.h
            entries.append(entry("memory", compute.memory_time(6 * numel), shape={"bytes": 6 * numel}))
    for mbs in (1, 2, 4):
        for tp in (1, 8):
            flops = model.attention_flops(micro_batch=mbs, tp=tp, cp=1)
            entries.append(entry("attention", compute.attention_time(flops), shape={"b": mbs, "tp": tp}, work={"flops": flops}))
    for tp in (1, 2, 4):
        for mbs in (1, 2):
            cfg = ParallelConfig(tp=tp, dp=8 // tp, mbs=mbs)
            spans, net = groups_and_network(problem, cfg, None)
            lt = layer_time(model, cfg=cfg, kind=DENSE, spans=spans, net=net, compute=compute)
            strategy = Strategy(tp=tp, mbs=mbs)
            entries.append(entry("dense", lt.fwd_compute + lt.bwd_compute, strategy=dataclasses.asdict(strategy),
                                 work=layer_work(model.cfg, strategy, kind=DENSE)))
    return entries


def chosen_compute(problem) -> FittedCompute:
    # the fitted per-call overheads replace the accelerator's calibrated kernel_overhead_s
    return FittedCompute(RooflineCompute(dataclasses.replace(problem.accelerator, kernel_overhead_s=0.0, **TRUE)),
                         **TRUE_OVERHEADS)


def test_fit_recovers_the_parameters_that_generated_the_timings():
    problem = load(PROBLEM).problem
    truth = chosen_compute(problem)
    result = fit(synthetic_entries(problem, truth), problem.accelerator)
    acc = result.compute.accelerator
    for name, value in TRUE.items():
        assert getattr(acc, name) == pytest.approx(value, rel=1e-4), name
    for name, value in TRUE_OVERHEADS.items():
        assert getattr(result.compute, name) == pytest.approx(value, rel=1e-3), name
    assert acc.peak_flops == problem.accelerator.peak_flops and acc.hbm_bandwidth == problem.accelerator.hbm_bandwidth
    assert result.samples == {"memory": 12, "gemm": 48, "attention": 6, "layers": 6}
    assert max(result.rms_relative_error.values()) < 1e-4


def test_fit_keeps_the_shipped_efficiency_of_a_class_it_has_no_measurements_of():
    problem = load(PROBLEM).problem
    gemms = [Gemm("g", 4096, 4096, k) for k in (1024, 4096)]
    # 50% of peak, no overhead: 4096 x 4096 is 32 x 16 = 512 output tiles of 128 x 256, 4 waves on 132
    # SMs, so t = 4 x 132 x (2 x 128 x 256 x k) / (0.5 peak): 3 % more than 2mnk / (0.5 peak)
    timed = [entry("gemm", 4 * 132 * 2 * 128 * 256 * g.k / (0.5 * problem.accelerator.peak_flops),
                   shape={"m": g.m, "n": g.n, "k": g.k}) for g in gemms]
    result = fit(timed, problem.accelerator)
    assert result.compute.accelerator.gemm_efficiency == pytest.approx(0.5, rel=1e-4)
    assert result.compute.gemm_overhead_s == pytest.approx(0.0, abs=1e-9)
    assert result.compute.accelerator.attention_efficiency == problem.accelerator.attention_efficiency
    assert result.compute.memory_overhead_s == 0.0


# --- the cache -------------------------------------------------------------------------------
def test_cache_keys_by_device_dtype_kind_shape_and_strategy(tmp_path):
    cache = Cache(tmp_path / "p.json")
    a = entry("dense", 1.0, shape={"hidden_size": 256}, strategy={"tp": 1, "mbs": 1})
    cache.add(a)
    cache.add(dataclasses.replace(a, seconds=2.0))  # the same measurement again replaces it
    cache.add(dataclasses.replace(a, strategy={"tp": 2, "mbs": 1}))
    cache.add(dataclasses.replace(a, shape={"hidden_size": 512}))
    cache.add(dataclasses.replace(a, device="NVIDIA H200"))
    cache.add(dataclasses.replace(a, dtype="fp8"))
    cache.add(dataclasses.replace(a, kind="moe"))
    assert len(cache.entries) == 6
    assert cache.entries[a.key].seconds == 2.0
    cache.save()
    again = Cache.load(tmp_path / "p.json")
    assert again.entries == cache.entries
    assert len(again.select(accelerator="h100_sxm")) == 5  # the fp8 one is another dtype
    assert again.select(accelerator="h200") == []


def test_cache_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_path() == tmp_path / "nest-megatron" / "profiles.json"


@pytest.mark.parametrize("text, says", [("{not json", "not a profile cache"), ('{"format": 99, "entries": []}', "format 99"),
                                        ('{"format": 1, "entries": [{"kind": "gemm"}]}', "malformed entry")])
def test_a_bad_cache_file_is_one_clear_error(tmp_path, capsys, text, says):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(NestError, match=says):
        Cache.load(path)
    assert says in one_line_error(capsys, "plan", *PROBLEM, f"cache={path}")
    assert says in one_line_error(capsys, "profile", *PROBLEM, f"cache={path}")
    assert path.read_text() == text  # left as it was


# --- plan uses a cache -----------------------------------------------------------------------
def test_plan_and_evaluate_price_with_the_fitted_model_when_a_cache_has_profiles(tmp_path):
    problem = load(PROBLEM).problem
    truth = chosen_compute(problem)
    cache = Cache(tmp_path / "profiles.json")
    for e in synthetic_entries(problem, truth):
        cache.add(e)
    cache.save()
    pins = ["plan.tp=4", "plan.pp=1", "plan.mbs=1", "plan.zero=1", "plan.recompute=none"]
    with_cache = api.evaluate([*PROBLEM, *pins, f"cache={cache.path}"])
    # Independently: the cost model priced with the chosen compute model directly, not the fitted one.
    cfg = ParallelConfig(tp=4, sp=True, dp=2, mbs=1, zero=1)
    expected = estimate(dataclasses.replace(problem, compute=truth), cfg)
    assert with_cache.predicted["step_time_s"] == pytest.approx(expected.step_time, rel=1e-4)
    assert with_cache.search["compute"].startswith(f"fitted from {len(cache.entries)} profiles in {cache.path}")
    roofline = api.evaluate([*PROBLEM, *pins, f"cache={cache.path}", "profile.use=false"])
    assert roofline.predicted["step_time_s"] == pytest.approx(estimate(problem, cfg).step_time, rel=1e-9)
    assert "profile.use=false" in roofline.search["compute"]

    planned = api.plan([*PROBLEM, "plan.tp=4", "plan.pp=1", f"cache={cache.path}"])
    assert planned.search["compute"].startswith("fitted from")


def test_plan_says_when_there_is_no_profile(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(for_plan, "SHIPPED", tmp_path / "shipped")  # whatever profiles the project ships
    done = api.evaluate([*PROBLEM, "plan.tp=8"])
    assert done.search["compute"].startswith("roofline with the shipped efficiencies (no profiles of h100_sxm in")
    # a cache of another accelerator only is no profile of this one
    cache = Cache(tmp_path / "nest-megatron" / "profiles.json")
    cache.add(entry("gemm", 1e-3, shape={"m": 1, "n": 1, "k": 1}, accelerator="a100_80gb"))
    cache.save()
    assert api.evaluate([*PROBLEM, "plan.tp=8"]).search["compute"].startswith("roofline")


def test_profiles_measured_on_a_cpu_do_not_price_a_gpu(tmp_path):
    # The CPU smoke run's cache: profiles of h100_sxm timed on the CPU (device "cpu"), here with the timings
    # of a chosen compute model so that a fit from them is recognisable.
    problem = load(PROBLEM).problem
    truth = chosen_compute(problem)
    cache = Cache(tmp_path / "profiles.json")
    cpu_entries = [dataclasses.replace(e, device="cpu") for e in synthetic_entries(problem, truth)]
    for e in cpu_entries:
        cache.add(e)
    cache.save()
    measured = len(cache.entries)  # distinct keys (synthetic_entries repeats some shapes)
    pins = ["plan.tp=4", "plan.pp=1", "plan.mbs=1", "plan.zero=1", "plan.recompute=none"]
    cfg = ParallelConfig(tp=4, sp=True, dp=2, mbs=1, zero=1)
    done = api.evaluate([*PROBLEM, *pins, f"cache={cache.path}"])
    assert done.search["compute"] == (f"roofline with the shipped efficiencies ({measured} profiles of "
                                      f"h100_sxm in {cache.path} were measured on cpu; profile.allow_cpu=true uses them)")
    assert done.predicted["step_time_s"] == pytest.approx(estimate(problem, cfg).step_time, rel=1e-9)
    # the CPU smoke run asks for them
    allowed = api.evaluate([*PROBLEM, *pins, f"cache={cache.path}", "profile.allow_cpu=true"])
    assert allowed.search["compute"].startswith(f"fitted from {measured} profiles in {cache.path}")
    expected = estimate(dataclasses.replace(problem, compute=truth), cfg)
    assert allowed.predicted["step_time_s"] == pytest.approx(expected.step_time, rel=1e-4)

    # GPU profiles beside them: the fit uses the H100 ones only and says what it left out. The H100 ones are
    # the same timings (keyed apart by device), so the fit still recovers `truth`.
    for e in cpu_entries:
        cache.add(dataclasses.replace(e, device="NVIDIA H100 80GB HBM3"))
    cache.add(entry("gemm", 1.0, shape={"m": 1, "n": 1, "k": 1}, device="NVIDIA A100-SXM4-80GB"))  # another GPU
    cache.save()
    mixed = api.evaluate([*PROBLEM, *pins, f"cache={cache.path}"])
    assert mixed.search["compute"].startswith(f"fitted from {measured} profiles in {cache.path}: ")
    assert mixed.search["compute"].endswith(f" (not used: {measured + 1} profiles of h100_sxm in {cache.path} "
                                            "were measured on NVIDIA A100-SXM4-80GB, cpu)")
    assert mixed.predicted["step_time_s"] == pytest.approx(expected.step_time, rel=1e-4)


def test_cpu_profiles_in_the_users_cache_do_not_hide_the_shipped_gpu_profile(monkeypatch, tmp_path):
    # `nest-megatron profile` on a login node fills the default cache with CPU timings of h100_sxm; the
    # profile shipped for h100_sxm (measured on the GPU) still prices the plan, and the note says what was left out.
    problem = load(PROBLEM).problem
    truth = chosen_compute(problem)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(for_plan, "SHIPPED", tmp_path / "shipped")
    users = Cache(tmp_path / "nest-megatron" / "profiles.json")
    shipped = Cache(tmp_path / "shipped" / "h100_sxm.json")
    for e in synthetic_entries(problem, truth):
        users.add(dataclasses.replace(e, device="cpu"))
        shipped.add(dataclasses.replace(e, device="NVIDIA H100 80GB HBM3"))
    users.save()
    shipped.save()
    pins = ["plan.tp=4", "plan.pp=1", "plan.mbs=1", "plan.zero=1", "plan.recompute=none"]
    done = api.evaluate([*PROBLEM, *pins])
    assert done.search["compute"].startswith(f"fitted from {len(shipped.entries)} profiles in {shipped.path}: ")
    assert done.search["compute"].endswith(f" (not used: {len(users.entries)} profiles of h100_sxm in {users.path} "
                                           "were measured on cpu; profile.allow_cpu=true uses them)")
    expected = estimate(dataclasses.replace(problem, compute=truth), ParallelConfig(tp=4, sp=True, dp=2, mbs=1, zero=1))
    assert done.predicted["step_time_s"] == pytest.approx(expected.step_time, rel=1e-4)


def test_profile_checks_its_cache_path_before_it_profiles(capsys, monkeypatch, tmp_path):
    from nest_megatron.profile import runner

    def never(*args, **kwargs):
        raise AssertionError("profiled before the cache path was checked")

    monkeypatch.setattr(runner, "run_tasks", never)
    (tmp_path / "adir").mkdir()
    problem = ["model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=1", "solver.micro_batch_sizes=[1]"]
    assert one_line_error(capsys, "profile", *problem, "cache=/proc/x.json").strip() == (
        "nest-megatron profile: error: cache=/proc/x.json: cannot write in /proc (No such file or directory)")
    assert one_line_error(capsys, "profile", *problem, f"cache={tmp_path / 'adir'}").strip() == (
        f"nest-megatron profile: error: cache={tmp_path / 'adir'}: is a folder; give a file path")


@pytest.mark.parametrize("override, says", [
    ("cache=/nonexistent/profiles.json", "cache=/nonexistent/profiles.json: no such profile cache"),
    ("profile.repeats=0", "profile.repeats=0: allowed 1..1000"),
    ("profile.warmup=-1", "profile.warmup=-1: allowed 0..1000"),
    ("profile.local_devices=0", "profile.local_devices=0: allowed 1..1048576"),
    ("profile.repeat=3", "profile.repeat: no such key; did you mean profile.repeats?"),
])
def test_bad_profile_input_is_one_line_and_exit_2(capsys, override, says):
    assert says in one_line_error(capsys, "plan", *PROBLEM, "plan.tp=8", override)


# --- nest-megatron profile on this CPU ------------------------------------------------------
@pytest.mark.slow
def test_profile_command_times_tiny_gpt_in_process_across_processes_and_as_a_shard(tmp_path):
    """Four devices, two local ones: TP 1 runs in this process, TP 2 as two gloo processes under
    torchrun (collectives included), TP 4 as one rank's shard on a fake process group plus the
    modelled collectives."""
    path = tmp_path / "profiles.json"
    done = cli("profile", "model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=4",
               "train.global_batch_size=8", "solver.micro_batch_sizes=[1]", "plan.cp=1", "profile.local_devices=2",
               "profile.warmup=0", "profile.repeats=1", f"cache={path}")
    assert done.returncode == 0, done.stderr[-3000:]
    entries = list(Cache.load(path).entries.values())
    assert {e.device for e in entries} == {"cpu"} and {e.accelerator for e in entries} == {"h100_sxm"}
    gemms = {(e.shape["m"], e.shape["n"], e.shape["k"]) for e in entries if e.kind == "gemm"}
    # tiny_gpt: h 256, ffn 1024, 8 heads, s 128, vocab 1024 (a multiple of 128 x tp already).
    # mbs 1 -> 128 tokens; QKV n = 3 x 256 / tp, proj k = 256 / tp, FC1 n = 1024 / tp, FC2 k = 1024 / tp,
    # output n = 1024 / tp.
    expected = {(128, 768, 256), (128, 256, 256), (128, 1024, 256), (128, 256, 1024),  # TP 1
                (128, 384, 256), (128, 256, 128), (128, 512, 256), (128, 256, 512),  # TP 2
                (128, 192, 256), (128, 256, 64)}  # TP 4 (its FC1, FC2 and output are (128, 256, 256))
    assert gemms == expected
    layers = {(e.kind, e.strategy["tp"], e.includes_comm) for e in entries if e.kind in ("dense", "embedding", "output")}
    assert layers == {(kind, tp, tp == 2) for kind in ("dense", "embedding", "output") for tp in (1, 2, 4)}
    dense = {e.strategy["tp"]: e for e in entries if e.kind == "dense"}
    assert dense[1].modelled_comm_s == 0 < dense[2].modelled_comm_s < dense[4].modelled_comm_s
    assert dense[2].strategy["sp"] is True and dense[4].strategy["sp"] is True and dense[2].versions["torch"]
    assert "compute model for h100_sxm:" in done.stdout and f"written to {path}" in done.stdout

    assert ("no GPU: timing on the CPU; these profiles will not price plans for accelerator=h100_sxm unless "
            "profile.allow_cpu=true") in done.stdout.splitlines()

    planned = cli("plan", "model=tiny_gpt", "cluster=dgx_h100_superpod", "cluster.num_devices=4",
                  "train.global_batch_size=8", f"cache={path}", "profile.allow_cpu=true", "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["search"]["compute"].startswith(f"fitted from {len(entries)} profiles in {path}")


@pytest.mark.slow
def test_profile_command_times_a_moe_layer_in_process(tmp_path):
    path = tmp_path / "profiles.json"
    done = cli("profile", "model=tiny_moe", "cluster=dgx_h100_superpod", "cluster.num_devices=1",
               "train.global_batch_size=8", "solver.micro_batch_sizes=[1]", "profile.warmup=0", "profile.repeats=1",
               f"cache={path}")
    assert done.returncode == 0, done.stderr[-3000:]
    kinds = {e.kind for e in Cache.load(path).entries.values()}
    assert kinds == {"gemm", "attention", "memory", "moe", "embedding", "output"}
    routed = {(e.shape["m"], e.shape["n"]) for e in Cache.load(path).entries.values() if e.kind == "gemm"}
    # experts' FC1, one GEMM of the group: 128 tokens x top-2 = 256 rows over the 4 experts (ep 1) = 64 rows,
    # 2 x 512 (SwiGLU) columns
    assert (64, 1024) in routed


# --- scripts/pretrain_gpt.py on a GPU, as far as a CPU can check it ---------------------------
class AskedDevices(TorchFunctionMode):
    """Records the device each torch call asks for and makes the tensor on the CPU (no GPU here)."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("device") is not None:
            self.asked.append(str(kwargs["device"]))
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def test_pretrain_gpt_gathers_the_layer_split_on_the_training_device():
    # NCCL, the backend of a GPU run, serves CUDA tensors only: an all_gather of a CPU tensor fails
    # there ("No backend type associated with device type cpu"), which the gloo runs never show.
    pretrain = load_module(ROOT / "scripts" / "pretrain_gpt.py")
    # One pipeline rank holding two virtual stages of 3 and 2 layers, each wrapped (DDP(Float16Module(GPTModel))).
    chunks = [SimpleNamespace(module=SimpleNamespace(module=SimpleNamespace(decoder=SimpleNamespace(layers=[0] * n))))
              for n in (3, 2)]
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with AskedDevices() as mode:
            split = pretrain.layers_per_stage(chunks, None, "cuda")
    finally:
        if owned:
            dist.destroy_process_group()
    assert split == [5] and mode.asked == ["cuda"]


@pytest.mark.slow  # imports megatron-core (~10 s of a 2-core CPU)
def test_moe_router_runs_without_transformer_engine(monkeypatch):
    # megatron-core binds moe_utils.te_general_gemm only when Transformer Engine imports (it is on
    # neither this machine nor the GPU one), yet its router reads the name: every MoE forward raised
    # NameError on a GPU, where trace/cpu_megatron.py's patches do not run.
    import torch
    from megatron.core.transformer.moe import moe_utils

    from nest_megatron.trace.cpu_megatron import bind_missing_te_gemm

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # as megatron-core imports without TE
    tokens, experts = torch.randn(6, 4), torch.randn(3, 4)
    with pytest.raises(NameError, match="te_general_gemm"):
        moe_utils.router_gating_linear(tokens, experts, None, torch.float32)
    bind_missing_te_gemm()
    logits = moe_utils.router_gating_linear(tokens, experts, None, torch.float32)
    assert torch.allclose(logits, tokens @ experts.T)  # one logit per token and expert: the plain product
