"""One parallel configuration: everything the planner chooses except the layer split and placement."""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE_KINDS = ("none", "selective", "full")
# megatron-core's selective recompute modules (--recompute-modules; transformer_config.py recompute_modules, the
# allowed set at Megatron-LM transformer_config.py:1945-1956 less the gated-DeltaNet and mHC ones) and its default.
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
ZERO_STAGES = (0, 1, 2, 3)
RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")
# Megatron's --cp-comm-type values the planner prices, Transformer Engine's three exchanges over one CP group:
# p2p (K/V ring, Megatron's default), a2a (Ulysses: Q, K, V and the output all-to-all over the heads),
# all_gather (K/V gathered). TE's fourth, a2a+p2p, needs hierarchical CP groups the planner does not build.
CP_COMM_TYPES = ("p2p", "a2a", "all_gather")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallel width
    vpp: int = 1  # virtual pipeline stages per pipeline rank
    sp: bool = False  # sequence parallel
    mbs: int = 1  # micro-batch size
    zero: int = 1  # 0: DDP, 1: distributed optimizer, 2/3: Megatron-FSDP (optim_grads / +params)
    recompute: str = "none"  # none | selective | full
    # With full recompute: layers recomputed per stage (the first n of each virtual stage);
    # None means every layer.
    recompute_num_layers: int | None = None
    # With selective recompute: the modules recomputed (RECOMPUTE_MODULES, in that order); cost/recompute.py.
    recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES
    order: str = "tp-cp-ep-dp-pp"
    cp_comm_type: str = "p2p"  # --cp-comm-type with CP > 1 (CP_COMM_TYPES)
    # --overlap-moe-expert-parallel-comm: a MoE layer's EP all-to-alls of one micro-batch beside another's computation
    # in the schedule's steady state (cost/a2a_overlap.py)
    moe_a2a_overlap: bool = False
    # --num-distributed-optimizer-instances: the data-parallel ranks split into this many replicas of the sharded
    # state (the distributed optimizer's partial instances; Megatron-FSDP's hybrid sharding), each sharding it over
    # dp x cp / instances ranks
    distributed_optimizer_instances: int = 1
    # --cpu-offloading-num-layers: the first n decoder layers' saved activations live in host memory between their
    # forward and backward (cost/offload.py)
    cpu_offloading_num_layers: int = 0
    # --microbatch-group-size-per-virtual-pipeline-stage: the interleaved schedule runs each model chunk over this
    # many micro-batches at a time; None: pp, Megatron's default (model_parallel_config.py:567-568). Read with vpp > 1.
    microbatch_group_size_per_vp_stage: int | None = None

    @property
    def microbatch_group(self) -> int:
        """The micro-batches the interleaved schedule runs a model chunk over at a time."""
        return self.microbatch_group_size_per_vp_stage or self.pp

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """The modules selective recompute runs again; () without selective recompute."""
        return self.recompute_modules if self.recompute == "selective" else ()

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dense_shards(self) -> int:
        """The ranks ZeRO shards a dense parameter's state over: dp x cp, within one optimizer instance."""
        return self.dp * self.cp // self.distributed_optimizer_instances

    @property
    def expert_shards(self) -> int:
        """The ranks ZeRO shards an expert parameter's state over: the expert DP, within one optimizer instance."""
        return self.expert_dp // self.distributed_optimizer_instances

    @property
    def expert_dp(self) -> int:
        """Data-parallel width of the expert weights: the non-expert tp*cp*dp ranks of a stage
        regrouped as etp x ep x expert_dp (megatron-core's expert rank generator)."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)
