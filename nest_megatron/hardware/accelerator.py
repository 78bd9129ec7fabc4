"""An accelerator in SI units, converted once from its config."""

from __future__ import annotations

from dataclasses import dataclass

from nest_megatron.config.schema import AcceleratorConfig

GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16, FLOP/s
    memory_bytes: float  # usable device memory, B
    hbm_bandwidth: float  # B/s
    gemm_efficiency: float
    attention_efficiency: float
    memory_bound_efficiency: float
    reserved_memory_bytes: float  # runtime allowance never available to the model, B
    gemm_fp8_efficiency: float = 0.6  # fraction of the fp8 peak a large fp8 GEMM reaches
    sm_count: int = 132  # streaming multiprocessors: a GEMM's tiles run in waves of this many
    kernel_overhead_s: float = 0.0  # launch and tail time of one GEMM or attention kernel, s
    host_overhead_s: float = 0.0  # host time to issue one operator, s (cost/host.py)
    peak_fp8_flops: float | None = None  # dense fp8 tensor-core peak, FLOP/s; None: no fp8 tensor cores
    mxfp8: bool = False  # block-scaled MXFP8 in hardware (Blackwell)
    # one device's copies to or from host memory, per direction, with the host's devices all copying, B/s; None: unknown
    host_link_bandwidth: float | None = None
    host_memory_bytes: float | None = None  # host memory a device's pinned buffers may take, B; None: unknown


def accelerator_from_config(cfg: AcceleratorConfig, *, memory_gib: float | None = None) -> Accelerator:
    """`memory_gib` overrides the device memory (a cluster that models a different capacity)."""
    return Accelerator(
        name=cfg.name,
        peak_flops=cfg.peak_bf16_tflops * 1e12,
        memory_bytes=(memory_gib if memory_gib is not None else cfg.memory_gib) * GIB,
        hbm_bandwidth=cfg.hbm_bandwidth_gb_per_s * 1e9,
        gemm_efficiency=cfg.gemm_efficiency,
        attention_efficiency=cfg.attention_efficiency,
        memory_bound_efficiency=cfg.memory_bound_efficiency,
        reserved_memory_bytes=cfg.reserved_memory_gib * GIB,
        gemm_fp8_efficiency=cfg.gemm_fp8_efficiency,
        sm_count=cfg.sm_count,
        kernel_overhead_s=cfg.kernel_overhead_us * 1e-6,
        host_overhead_s=cfg.host_overhead_us * 1e-6,
        peak_fp8_flops=cfg.peak_fp8_tflops * 1e12 if cfg.peak_fp8_tflops is not None else None,
        mxfp8=cfg.mxfp8,
        host_link_bandwidth=cfg.host_link_gb_per_s * 1e9 if cfg.host_link_gb_per_s is not None else None,
        host_memory_bytes=cfg.host_memory_gib * GIB if cfg.host_memory_gib is not None else None,
    )
