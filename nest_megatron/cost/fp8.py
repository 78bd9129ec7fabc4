"""What Transformer Engine's FP8 recipes write and keep per element they quantise (train.fp8_recipe).

Sources: Transformer Engine v2.11 (megatron-core 0.16.1 takes transformer-engine >=2.9,<2.12), Megatron-LM d98e8a6.

A quantised tensor is up to two FP8 copies of 1 byte an element, each with its scales:
- rowwise, the layout the forward GEMM reads, and columnwise, the other operand order the backward's GEMMs read
  (the input X for the weight gradient, the weight W and the output gradient dY for dgrad / wgrad);
- delayed and tensorwise (one scale per tensor): Hopper's FP8 GEMMs take only the TN layout, so the columnwise copy
  is a transpose, written beside the rowwise data; where FP8 GEMMs take any layout (Blackwell: TE's
  is_non_tn_fp8_gemm_supported, pytorch/utils.py:491, compute capability 10.x) the one copy serves both
  (pytorch/csrc/quantizer.cpp:137: with_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported());
- mxfp8 (MXFP8BlockScaling, common/recipe/__init__.py:265): one E8M0 scale (1 byte) per 32 consecutive values,
  along the row or along the column, so "the quantized tensor and its transpose are not numerically equivalent":
  both copies are quantised from the bf16 input (pytorch/tensor/mxfp8_tensor.py:122-143: uint8 data and a uint8
  scale per 32 elements, rowwise and columnwise), on every accelerator;
- blockwise (Float8BlockScaling, recipe/__init__.py:306): 1 x 128 blocks for activations and gradients, 128 x 128
  for weights (w_block_scaling_dim = 2, :339), an fp32 scale per block (float8_blockwise_tensor.py:253, 271), both
  copies.

Per-tensor current scaling (tensorwise) reads the bf16 tensor once more for its amax before the cast; delayed
scaling takes the scale from the amax history, fused into the cast.
"""

from __future__ import annotations

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
BF16_READ = 2.0  # bytes: the cast reads the bf16 tensor
AMAX_READ = {"tensorwise": 2.0}  # bytes: one more read of it for the per-tensor amax
# Scale bytes per element of one copy: activations and gradients, and weights where the blocks differ.
SCALE_BYTES = {"delayed": 0.0, "tensorwise": 0.0, "blockwise": 4 / 128, "mxfp8": 1 / 32}
WEIGHT_SCALE_BYTES = {**SCALE_BYTES, "blockwise": 4 / 128**2}


def copies(recipe: str, *, any_layout: bool) -> int:
    """FP8 copies TE writes of a tensor both passes read: two, but one for a per-tensor recipe whose GEMMs take
    any layout."""
    return 1 if any_layout and recipe in ("delayed", "tensorwise") else 2


def quantise_bytes(recipe: str, *, any_layout: bool) -> float:
    """HBM bytes per element of one cast: read the bf16 tensor (twice with tensorwise), write every copy and its
    scales. Hopper, delayed: 2 + 2 x 1 = 4; mxfp8 anywhere: 2 + 2 x (1 + 1/32) = 4.0625."""
    return BF16_READ + AMAX_READ.get(recipe, 0.0) + copies(recipe, any_layout=any_layout) * (1 + SCALE_BYTES[recipe])


def weight_copy_bytes(recipe: str, *, any_layout: bool) -> float:
    """Bytes per parameter of the FP8 weight copies TE caches for the step beside the bf16 weight (the forward's
    rowwise and dgrad's columnwise). Hopper, delayed: 2; Blackwell, delayed: 1; mxfp8: 2 + 2/32."""
    return copies(recipe, any_layout=any_layout) * (1 + WEIGHT_SCALE_BYTES[recipe])


def saved_input_bytes(recipe: str) -> float:
    """Bytes per element of a linear's input kept for its weight gradient: the one copy the wgrad GEMM reads (TE
    drops the other after the forward GEMM: pytorch/module/linear.py:385-399), with its scales."""
    return 1 + SCALE_BYTES[recipe]
