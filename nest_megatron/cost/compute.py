"""Time of the computation on one device: a roofline with efficiencies, shape-aware for GEMMs.

`ComputeModel` is the contract; `RooflineCompute` fills it from the accelerator's peak numbers and
efficiency factors. A profile table (measured kernel times per op class and shape) is a second
implementation of the same methods (profile/fit.py).

A GEMM is run by a kernel that tiles its [m, n] output over the streaming multiprocessors (SMs):
ceil(m / TILE_M) x ceil(n / TILE_N) tiles, one tile per SM at a time, so the kernel takes
ceil(tiles / SMs) waves of one tile's 2 TILE_M TILE_N k FLOPs each, at the SM's share of the peak.
A large GEMM reaches the efficiency; a small one, or one whose last wave is nearly empty (wave
quantisation), less. A grouped GEMM (a device's experts) is one GEMM per expert over a few streams
(`GROUPED_GEMM_STREAMS`). Every GEMM and attention kernel also pays a fixed launch and tail time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.model.spec import Gemm

BF16 = 2  # bytes
FP8 = 1  # bytes

# The output tile of one SM: 128 x 256 is the largest of CUTLASS's Hopper warp-specialised GEMM
# tiles (cutlass/include/cutlass/gemm/collective/builders/sm90_gmma_builder.inl) and what cuBLAS
# picks for large bf16 / fp8 training GEMMs; large GEMMs are insensitive to it, small ones are not.
TILE_M, TILE_N = 128, 256

# A grouped GEMM on Hopper is one cuBLAS GEMM per expert, issued round-robin on 4 streams. Transformer Engine's
# GroupedLinear (Megatron's TEGroupedMLP): general_grouped_gemm (pytorch/cpp_extensions/gemm.py:157-208 at v2.9) ->
# nvte_multi_tensor_gemm -> multi_stream_cublas_gemm, GEMM i on compute stream i % 4 (common/gemm/cublaslt_gemm.cu
# :924-965; nvte_multi_stream_cublas_gemm :678-700 at v2.7), 4 streams (common/util/multi_stream.cpp:52-55); its
# CUTLASS grouped GEMM only with NVTE_USE_CUTLASS_GROUPED_GEMM=1 (cublaslt_gemm.cu:1015-1025 at v2.9), which no
# priced recipe sets. grouped_gemm's gmm (AutoModel's experts, Megatron's legacy GroupedMLP) does the same on Hopper
# (fanshiqing/grouped_gemm v1.1.4 csrc/grouped_gemm.cu:16, :274-285, cuBLAS unless built for sm80 :399-402). So the
# experts run in rounds of 4 concurrent GEMMs, each round its tiles' waves and one launch and tail.
GROUPED_GEMM_STREAMS = 4

# Flash attention's backward runs five GEMM-shaped products (S = QK^T again, dP = dO V^T, dV = P^T dO,
# dQ = dS K, dK = dS^T Q) where the forward runs two: 2.5 x the forward FLOPs (Dao, FlashAttention-2,
# arXiv 2307.08691, Sec. 3.1), at the same efficiency.
ATTENTION_BACKWARD_FACTOR = 2.5


# Flash attention's throughput by head dimension relative to 128, the size accelerator.attention_efficiency
# describes: smaller heads do less work per byte of K / V streamed (FlashAttention-3, Shah et al., arXiv
# 2407.08608, Fig. 5: bf16 forward on H100 at 16k tokens, head dim 64 ~ 0.75 x and head dim 256 ~ 1.1 x the
# TFLOP/s of head dim 128). Between the points, linear in log2(head dim); outside, the nearest.
HEAD_DIM_THROUGHPUT = ((64, 0.75), (128, 1.0), (256, 1.1))


def head_dim_factor(head_dim: int) -> float:
    points = HEAD_DIM_THROUGHPUT
    if head_dim <= points[0][0]:
        return points[0][1]
    for (d0, f0), (d1, f1) in zip(points, points[1:]):
        if head_dim <= d1:
            return f0 + (f1 - f0) * (math.log2(head_dim) - math.log2(d0)) / (math.log2(d1) - math.log2(d0))
    return points[-1][1]


class ComputeModel(Protocol):
    def gemm_time(self, gemm: Gemm) -> float: ...

    def attention_time(self, flops: float, head_dim: int = 128) -> float: ...

    def memory_time(self, nbytes: float) -> float: ...

    def with_bf16_gemms(self) -> ComputeModel: ...  # the same model, GEMMs in bf16 (the output layer)


@dataclass(frozen=True)
class RooflineCompute:
    accelerator: Accelerator
    fp8: bool = False  # GEMMs run in fp8 (train.precision=fp8) at the fp8 peak

    @property
    def gemm_flops(self) -> float:
        """What a large GEMM reaches, FLOP/s."""
        a = self.accelerator
        if self.fp8:
            return a.peak_fp8_flops * a.gemm_fp8_efficiency
        return a.peak_flops * a.gemm_efficiency

    def gemm_time(self, gemm: Gemm) -> float:
        """A grouped GEMM's rounds of up to GROUPED_GEMM_STREAMS concurrent expert GEMMs, one after another
        (`_round_time`); one round for a plain GEMM."""
        full, rest = divmod(gemm.count, GROUPED_GEMM_STREAMS)
        return full * self._round_time(gemm, GROUPED_GEMM_STREAMS) + (self._round_time(gemm, rest) if rest else 0.0)

    def _round_time(self, gemm: Gemm, concurrent: int) -> float:
        """`concurrent` GEMMs of `gemm`'s shape on as many streams: max(their tiles' waves at the SMs' share of the
        achieved FLOP/s, their operand and result bytes at the achieved HBM bandwidth) + one launch and tail (the
        streams' overlap)."""
        a = self.accelerator
        # A GEMM thinner than a tile gets a tile its size (cuBLAS picks smaller tiles, or a GEMV).
        tile_m, tile_n = min(TILE_M, gemm.m), min(TILE_N, gemm.n)
        tiles = concurrent * math.ceil(gemm.m / tile_m) * math.ceil(gemm.n / tile_n)
        waves = math.ceil(tiles / a.sm_count)
        compute = waves * a.sm_count * 2.0 * tile_m * tile_n * gemm.k / self.gemm_flops
        width = FP8 if self.fp8 else BF16
        nbytes = concurrent * (width * (gemm.m * gemm.k + gemm.k * gemm.n) + BF16 * gemm.m * gemm.n)
        return max(compute, nbytes / (a.hbm_bandwidth * a.memory_bound_efficiency)) + a.kernel_overhead_s

    def attention_time(self, flops: float, head_dim: int = 128) -> float:
        """The fused attention kernel (bf16 also in fp8 training: Transformer Engine keeps the
        core attention in bf16 unless --fp8-dot-product-attention)."""
        a = self.accelerator
        return flops / (a.peak_flops * a.attention_efficiency * head_dim_factor(head_dim)) + a.kernel_overhead_s

    def memory_time(self, nbytes: float) -> float:
        a = self.accelerator
        return nbytes / (a.hbm_bandwidth * a.memory_bound_efficiency)

    def with_bf16_gemms(self) -> RooflineCompute:
        return replace(self, fp8=False)
