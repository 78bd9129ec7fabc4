"""Time of the computation on one device: a roofline with efficiencies.

`ComputeModel` is the contract; `RooflineCompute` fills it from the accelerator's peak numbers and
efficiency factors. A profile table (measured kernel times per op class and shape) is a second
implementation of the same three methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.model.spec import Gemm

BF16 = 2  # bytes


class ComputeModel(Protocol):
    def gemm_time(self, gemm: Gemm) -> float: ...

    def attention_time(self, flops: float) -> float: ...

    def memory_time(self, nbytes: float) -> float: ...


@dataclass(frozen=True)
class RooflineCompute:
    accelerator: Accelerator

    def gemm_time(self, gemm: Gemm) -> float:
        """max(FLOPs / achieved FLOP/s, bytes of A, B and C / achieved HBM bandwidth)."""
        a = self.accelerator
        nbytes = BF16 * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n)
        return max(
            gemm.flops / (a.peak_flops * a.gemm_efficiency),
            nbytes / (a.hbm_bandwidth * a.memory_bound_efficiency),
        )

    def attention_time(self, flops: float) -> float:
        a = self.accelerator
        return flops / (a.peak_flops * a.attention_efficiency)

    def memory_time(self, nbytes: float) -> float:
        a = self.accelerator
        return nbytes / (a.hbm_bandwidth * a.memory_bound_efficiency)
