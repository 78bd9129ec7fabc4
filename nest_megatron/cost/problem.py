"""What the cost model is asked about: a model on a cluster with a batch, in SI units."""

from __future__ import annotations

from dataclasses import dataclass

from nest_megatron.cost.compute import ComputeModel, RooflineCompute
from nest_megatron.hardware.accelerator import Accelerator
from nest_megatron.hardware.topology import Topology
from nest_megatron.model.spec import ModelSpec


@dataclass(frozen=True)
class Problem:
    model: ModelSpec
    accelerator: Accelerator
    topology: Topology
    global_batch_size: int  # sequences per iteration
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False  # --tp-comm-overlap: TP collectives overlapped with the GEMMs (userbuffers)
    # The MoE token dispatcher (alltoall: Megatron's; allgather: megatron-core's default; deepep: DeepEP under
    # the flex dispatcher), from train.moe_dispatcher; and the router whose choices set how many ranks a token
    # goes to under DeepEP (learned | fake_balanced, AutoModel's benchmark gate, which only the fidelity bench
    # sets): layer.dispatch_copies.
    moe_dispatcher: str = "alltoall"
    moe_router: str = "learned"
    moe_permute_fusion: bool = False  # --moe-permute-fusion: Transformer Engine's fused (un)permutation
    cuda_graphs: bool = False  # train.cuda_graphs: each layer's pass one graph replay for the host (cost/host.py)
    defer_embedding_wgrad: bool = False  # train.defer_embedding_wgrad_compute: needs pp > 1 (solver/space.py), not priced
    # --delay-wgrad-compute: the experts' weight gradient after the backward's dispatch, with a configuration's EP
    # all-to-all overlap (ParallelConfig.moe_a2a_overlap; cost/a2a_overlap.py)
    delay_wgrad_compute: bool = False
    # The pipeline schedules a step runs, each filling and draining the pipeline over its share of the micro-batches:
    # 1 in Megatron (one schedule over all of them); more where a framework accumulates gradients over several
    # schedules (PyTorch pipelining under NeMo AutoModel, which only the fidelity bench prices).
    pipeline_runs: int = 1
    compute: ComputeModel | None = None  # None: the accelerator's roofline; a profile's fitted model otherwise

    @property
    def compute_model(self) -> ComputeModel:
        return self.compute or RooflineCompute(self.accelerator, fp8=self.model.numerics.fp8_recipe is not None)

    @property
    def num_devices(self) -> int:
        return self.topology.num_devices
