"""Typed schemas of every config group.

The YAML files under ``nest_megatron/hydra_configs/<group>/`` hold values only; each is merged onto the dataclass
of its group here, so a misspelt key or a value of the wrong type fails at load. Model keys are
Megatron-LM's argument names in snake_case (``--num-query-groups`` -> ``num_query_groups``).
Units are named in every key that carries one; the code converts to SI (bytes, seconds, FLOP/s,
bytes/s) once, in ``config/load.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A transformer's shape, as Megatron-LM's arguments name it."""

    name: str = MISSING
    family: str = "gpt"  # gpt (causal decoder) | bert (bidirectional encoder)
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: Optional[int] = None  # None: multi-head attention (= num_attention_heads)
    kv_channels: Optional[int] = None  # None: hidden_size // num_attention_heads
    seq_length: int = MISSING
    vocab_size: int = MISSING
    make_vocab_size_divisible_by: int = 128
    # A hybrid stack (megatron-core MambaModel): one symbol per layer, M a Mamba-2 mixer, * attention, - an MLP,
    # E a MoE MLP (megatron/core/ssm/mamba_hybrid_layer_allocation.py Symbols); None: a transformer (GPTModel)
    hybrid_layer_pattern: Optional[str] = None
    # The Mamba-2 mixer's state size, head size and B/C groups; its heads (None: 2 x hidden_size / mamba_head_dim,
    # MambaMixer's expand 2); megatron-core 0.16.1 transformer_config.py:846-857
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    # Megatron's --padded-vocab-size: the embedding's rows as given, not padded further (None: vocab_size padded to
    # make_vocab_size_divisible_by x TP); megatron/training/argument_utils.py:474-476
    padded_vocab_size: Optional[int] = None
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # auto (Megatron's default: Transformer Engine picks cuDNN's fused attention or flash-attn), fused (cuDNN),
    # flash (flash-attn): fused kernels that keep no s^2 tensor; unfused (TE's UnfusedDotProductAttention), local
    # (megatron-core's DotProductAttention, needs --spec local): the softmax and the attention-over-values input
    # are kept.
    attention_backend: str = "auto"
    attention_softmax_in_fp32: bool = False  # unfused softmax computed (and kept) in fp32
    bias_swiglu_fusion: bool = True  # fused SwiGLU keeps only its input (Megatron's default)
    num_experts: Optional[int] = None  # None: dense MLP in every layer
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    # which layers have a MoE MLP: an integer N (layer i when i % N == 0) or a list of 0/1, one per layer (1: MoE),
    # e.g. [0, 0, 0, 1, ...] for DeepSeek-V3's first three dense layers
    moe_layer_freq: Any = 1
    moe_shared_expert_intermediate_size: Optional[int] = None
    # --moe-shared-expert-overlap: the shared expert computed beside the token dispatch (not priced: the cost model runs
    # it in turn); megatron-core then recomputes no shared_experts module (parallel/rules.py module_problem)
    moe_shared_expert_overlap: bool = False
    # latent MoE (megatron-core's TransformerConfig.moe_latent_size): the routed experts run at this width, not
    # hidden_size; fc1_latent_proj (h -> latent) before the token dispatch and fc2_latent_proj (latent -> h) after the
    # combine, both duplicated on every TP rank; the router and the shared expert read the h-wide input (megatron-core
    # 0.16.1 moe/moe_layer.py:169-193, 264-270, 339-345; moe/experts.py:540-570). None: experts at hidden_size
    moe_latent_size: Optional[int] = None
    # group-limited routing: the experts split into this many equal groups of consecutive experts
    moe_router_num_groups: Optional[int] = None
    # group-limited routing: a token's experts come from at most this many of the groups (None: no limit)
    moe_router_group_topk: Optional[int] = None
    # The busiest expert-parallel rank's routed tokens over the mean (>= 1): 1 for a balanced router
    # (aux-loss-free or forced balance); what the expert GEMMs and the all-to-all wait for.
    moe_load_imbalance: float = 1.0
    # token dropping: each expert takes at most ceil(tokens x topk / experts x this factor) of a rank's routed tokens
    # and drops the rest (None: dropless, Megatron's default)
    moe_expert_capacity_factor: Optional[float] = None
    # every expert gets exactly its capacity, padded: static shapes, and the alltoall dispatcher needs no token counts
    # on the host (cost/host.py)
    moe_pad_expert_input_to_capacity: bool = False
    squared_relu: bool = False  # relu(x)^2 MLP activation (Nemotron); not with swiglu
    qk_layernorm: bool = False  # normalization of each head's query and key
    # multi-head latent attention (megatron-core MLASelfAttention) instead of standard attention; the defaults
    # of its widths below are Megatron-LM's (arguments.py _add_mla_args)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # MLA: the query latent's width (None: queries projected from the hidden state)
    kv_lora_rank: int = 32  # MLA: the key/value latent's width
    qk_head_dim: int = 128  # MLA: a query's and a key's width per head without RoPE
    qk_pos_emb_head_dim: int = 64  # MLA: the decoupled RoPE part of a query and key per head (one key for all heads)
    v_head_dim: int = 128  # MLA: a value's width per head
    # multi-token prediction depths after the decoder, each a layer of the decoder's last kind with its own norms
    # and 2h -> h projection, on the last pipeline stage (None: none)
    mtp_num_layers: Optional[int] = None
    # A hybrid stack's depth: its layers, in hybrid_layer_pattern's symbols (Megatron-LM's unified
    # --hybrid-layer-pattern 'MAIN/DEPTH/DEPTH', one DEPTH per depth: models/hybrid/hybrid_layer_allocation.py
    # parse_hybrid_pattern at d98e8a6); None: the decoder's last layer, as a GPT stack's depth
    mtp_hybrid_pattern: Optional[str] = None
    # One depth's layers built once and run at every depth (TransformerConfig.mtp_use_repeated_layer,
    # transformer_config.py:82 at d98e8a6; --mtp-use-repeated-layer): the parameters of one depth, the work of all
    mtp_use_repeated_layer: bool = False
    mtp_loss_scaling_factor: float = 0.1  # the weight of the depths' loss (it changes no cost)
    # transformer_engine (its layer spec: MLA's down projections duplicated on every TP rank) | local (megatron-core's
    # own modules, as a traced model runs: MLA's down projections split over TP, unfused attention and SwiGLU, which
    # the plan prices and emits: trace/source.py local_spec_kernels)
    transformer_impl: str = "transformer_engine"
    # sliding-window attention over this many past tokens (Megatron's "left,right" = N,0); None: full
    window_size: Optional[int] = None
    # N: every N-th layer keeps full attention, the others slide (None: every layer slides)
    window_attn_skip_freq: Optional[int] = None
    # the attention softmax (megatron-core TransformerConfig.softmax_type): vanilla | off-by-one (a zero logit added
    # to each row's denominator) | learnable (a learnt per-head logit, attention sinks); Transformer Engine runs the
    # last two in cuDNN's fused attention or its unfused one, not flash-attn, and with CP only by a2a
    softmax_type: str = "vanilla"
    # Where the model and its per-layer costs come from: analytic (these keys, the formulas of model/spec.py and
    # cost/); hf (the architecture read from the Hugging Face config.json at hf_config, priced by the same formulas
    # and Transformer Engine's layers as a shipped config; with transformer_impl=local, traced as megatron); or a
    # traced model whose parameters, GEMMs, attention FLOPs and saved activations replace the formulas: megatron
    # (megatron-core's GPTModel of these keys, local layer spec, on the meta device), module (the nn.Module that
    # the factory `pkg.mod:function` returns; see nest_megatron/trace/module.py).
    source: str = "analytic"
    hf_config: Optional[str] = None  # path of a Hugging Face config.json (source=hf)
    module: Optional[str] = None  # pkg.mod:factory (source=module)


@dataclass
class AcceleratorConfig:
    """One device: what it computes and holds. Each YAML cites the source of every number."""

    name: str = MISSING
    peak_bf16_tflops: float = MISSING  # dense bf16 tensor-core peak, 1e12 FLOP/s
    peak_fp8_tflops: Optional[float] = None  # dense FP8 tensor-core peak, 1e12 FLOP/s (None: no FP8 tensor cores)
    mxfp8: bool = False  # block-scaled MXFP8 in hardware (Blackwell), what --fp8-recipe mxfp8 needs
    # FP8 GEMMs take either operand order (Blackwell, compute capability 10.x): Transformer Engine keeps no transposed
    # FP8 copy under the per-tensor recipes (its is_non_tn_fp8_gemm_supported; Hopper's FP8 GEMMs are TN only).
    fp8_gemm_any_layout: bool = False
    memory_gib: float = MISSING  # HBM capacity usable by the framework, GiB
    hbm_bandwidth_gb_per_s: float = MISSING  # 1e9 B/s
    # The fractions of the peaks that kernels reach; a profile cache (`nest-megatron profile`) fits
    # them from measurements instead.
    gemm_efficiency: float = 0.75  # fraction of the bf16 peak a large GEMM reaches (a profile fits it)
    attention_efficiency: float = 0.55  # fraction of the bf16 peak a fused attention kernel reaches (a profile fits it)
    memory_bound_efficiency: float = 0.8  # fraction of HBM bandwidth a memory-bound kernel reaches (a profile fits it)
    gemm_fp8_efficiency: float = 0.6  # fraction of the fp8 peak a large fp8 GEMM reaches
    sm_count: int = 132  # streaming multiprocessors: a GEMM's output tiles run in waves of this many
    kernel_overhead_us: float = 0.0  # launch and tail time of one GEMM or attention kernel, microseconds
    host_overhead_us: float = 0.0  # host (CPU) time eager PyTorch spends issuing one operator, microseconds
    # Bandwidth of one device's copies to and from host memory, per direction, while every device of the host copies
    # at once, 1e9 B/s: what activation offloading (--cpu-offloading-num-layers) moves over. None: not known, and
    # offloading is refused.
    host_link_gb_per_s: Optional[float] = None
    # Host memory per device, GiB: the node's memory over its devices, what the pinned buffers of offloaded
    # activations may take (cost/evaluate.py pinned_host_bytes). None: not known, and offloading is refused.
    host_memory_gib: Optional[float] = None
    # CUDA context, NCCL buffers, cuBLAS workspace and allocator fragmentation, GiB.
    reserved_memory_gib: float = 3.0


@dataclass
class LevelConfig:
    """One network level: devices grouped by locality; level 0 is inside a node."""

    name: str = MISSING
    fan_out: int = MISSING  # units of the level below in one unit of this level
    bandwidth_gb_per_s: float = MISSING  # per device, per direction, 1e9 B/s
    latency_s: float = MISSING  # per message, s
    oversubscription: float = 1.0  # downlink : uplink capacity of this level's switches
    efficiency: float = 1.0  # fraction of the bandwidth collectives reach here (NCCL, the fabric); calibrate fits it
    all_to_all_efficiency: float = 1.0  # fraction of that an all-to-all (MoE dispatch, a2a CP) reaches; calibrate fits it


@dataclass
class TorusConfig:
    """A k-dimensional torus (TPU pods), described by its dimensions and link speed."""

    dims: list[int] = field(default_factory=list)  # chips along each dimension, e.g. [4, 4, 4]
    link_bandwidth_gb_per_s: float = MISSING  # one link, one direction, 1e9 B/s
    hop_latency_s: float = MISSING  # per hop, s


@dataclass
class ClusterConfig:
    """The machines: an accelerator and a hierarchy of network levels."""

    name: str = MISSING
    topology: str = "hierarchical"  # hierarchical | torus (levels built from `torus`)
    levels: list[LevelConfig] = field(default_factory=list)  # level 0 first (inside a node); see cluster.levels[i]
    torus: Optional[TorusConfig] = None  # with topology: torus, see cluster.torus
    # Rescale the top level so that the cluster has this many devices (None: as described); a count that whole
    # units do not make fills them in order, the last one partly (37 nodes of 32-node SUs: 32 + 5).
    num_devices: Optional[int] = None
    # Device memory as a study models it, overriding the accelerator's (None: the accelerator's).
    device_memory_gib: Optional[float] = None
    # The level whose unit is one host, i.e. one torchrun node (0: a node is the lowest level).
    # Levels below it are inside a host: NVLink pairs or PCIe switches of a PCIe box.
    host_level: int = 0
    # The highest level whose links are NVLink: one of its units is an NVLink domain, which may hold several hosts
    # (a GB200 NVL72 rack: 18 trays of 4 GPUs on one NVLink switch fabric). Tensor-parallel (and expert-TP) groups
    # stay inside a domain, and may span its hosts; EP, CP and DP groups may leave it, priced by the levels they
    # cross. At or above host_level (None: host_level, NVLink ends at the host).
    nvlink_level: Optional[int] = None
    # The allocated nodes, a SLURM hostlist (n[01-12],n[21-24]): the plan's hosts, cluster.num_devices =
    # nodes x devices per node (None: SLURM_JOB_NODELIST inside a SLURM job, else unnamed nodes).
    nodes: Optional[str] = None
    # SLURM's topology.conf (tree plugin: SwitchName=... Nodes=... / Switches=...; block plugin: BlockName=...
    # Nodes=...): which switches or blocks the nodes hang off; a leaf switch or a block is a unit of the level
    # above the host, its parent one of the next level (blocks: fan_out consecutive blocks a unit)
    # (None: `scontrol show topology` inside a SLURM job with either plugin, else the levels' fan_outs).
    topology_conf: Optional[str] = None
    # Nodes of the allocation that are down (a SLURM hostlist, e.g. after a node failed mid-run): the plan
    # runs on the others, and the report draws these as failed in the allocation's tree.
    failed_nodes: Optional[str] = None


@dataclass
class TrainConfig:
    """The run: batch, precision and the overlap options Megatron users turn on."""

    global_batch_size: int = 1024  # sequences per iteration
    micro_batch_size: Optional[int] = None  # None: the planner chooses
    overlap_grad_reduce: bool = True  # --overlap-grad-reduce: DP gradient reduction behind the backward pass
    overlap_param_gather: bool = True  # --overlap-param-gather: the distributed optimizer's all-gather behind the forward
    precision: str = "bf16"  # bf16 | fp8 (--fp8-format hybrid: FP8 GEMMs through Transformer Engine, bf16 elsewhere)
    fp8_recipe: str = "delayed"  # --fp8-recipe with fp8: delayed | tensorwise | blockwise | mxfp8 (Blackwell only)
    tp_comm_overlap: bool = False  # --tp-comm-overlap: TP collectives behind the GEMMs (needs sequence parallel)
    grad_reduce_in_bf16: bool = False  # --grad-reduce-in-bf16: main gradients and their DP reduction in bf16
    cross_entropy_fusion: bool = False  # --cross-entropy-loss-fusion: the loss keeps no fp32 logits
    # --use-precision-aware-optimizer: Transformer Engine's FusedAdam keeps the master weights and Adam's moments in
    # the dtypes below (the distributed optimizer only, plan.zero=1); fp32 master weights as the bf16 weight plus
    # its 16 low bits.
    precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"  # --main-params-dtype with the precision-aware optimizer: fp32 | fp16
    exp_avg_dtype: str = "fp32"  # --exp-avg-dtype with the precision-aware optimizer: fp32 | fp16 | bf16 | fp8
    exp_avg_sq_dtype: str = "fp32"  # --exp-avg-sq-dtype with the precision-aware optimizer: fp32 | fp16 | bf16 | fp8
    # The MoE token dispatcher (--moe-token-dispatcher-type): alltoall | allgather | deepep (flex with the DeepEP
    # backend, --moe-flex-dispatcher-backend deepep: a token sent once to each rank that holds one of its experts).
    moe_dispatcher: str = "alltoall"
    # CUDA graphs (--cuda-graph-impl local | transformer_engine, or the deprecated --enable-cuda-graph /
    # --external-cuda-graph): each layer's pass is one graph replay for the host (cost/host.py). Read from the argv;
    # the plan does not emit the flag (its other requirements are the user's: Megatron-LM arguments.py:1953-1971)
    cuda_graphs: bool = False
    # --defer-embedding-wgrad-compute: the output layer's weight gradient deferred into the pipeline's cool-down
    # (megatron-core takes it only with pipeline parallelism: plans keep pp > 1). Read from the argv and emitted; its
    # time is not priced.
    defer_embedding_wgrad_compute: bool = False
    # --delay-wgrad-compute: the experts' weight gradient after the backward's dispatch (cost/a2a_overlap.py); it runs
    # only with the EP all-to-all overlap, so plans have the overlap (plan.moe_a2a_overlap=true) with it.
    delay_wgrad_compute: bool = False


@dataclass
class SolverConfig:
    """What the planner searches."""

    name: str = "dp"  # dp (the NEST dynamic program) | enumerate (every configuration, even splits: a check)
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # searched unless train.micro_batch_size
    zero_stages: list[int] = field(default_factory=lambda: [0, 1, 2, 3])  # 0 DDP, 1 distributed optimizer, 2/3 Megatron-FSDP
    recompute: list[str] = field(default_factory=lambda: ["none", "selective", "full"])  # activation recomputation
    # With full recompute: layers recomputed per stage (the first n; null: every layer).
    recompute_num_layers: list[Optional[int]] = field(default_factory=lambda: [None])
    # Megatron's rank orders (the second is --use-tp-pp-dp-mapping); node orders are searched under each.
    rank_orders: list[str] = field(default_factory=lambda: ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
    max_virtual_stages: int = 4  # largest --num-layers-per-virtual-pipeline-stage split tried (per rank)
    max_context_parallel: int = 8  # largest context-parallel size tried
    # --cp-comm-type values tried with CP > 1: Megatron's p2p (the K/V ring behind attention) | a2a | all_gather. Where
    # Transformer Engine runs none of them for a configuration (sliding-window attention refuses p2p, an off-by-one or
    # learnable softmax all but a2a: parallel/rules.py), the others it runs are tried instead; [p2p, a2a, all_gather] tries all (a slower search).
    cp_comm_types: list[str] = field(default_factory=lambda: ["p2p"])
    # --overlap-moe-expert-parallel-comm tried off and on, for a MoE GPT model with EP > 1 where the run allows it (the
    # alltoall or flex dispatcher, at most one MTP layer, no shared-expert overlap, no CUDA graphs: solver/space.py)
    moe_a2a_overlap: list[bool] = field(default_factory=lambda: [False, True])
    # --cpu-offloading-num-layers tried, as shares of the model's layers (rounded; at most all but the last): the
    # first layers' activations in host memory, where megatron-core offloads (pp 1, no recompute) and the accelerator
    # gives its host link (accelerator.host_link_gb_per_s). [0] (the default): never offload, since the host links
    # are estimates and their sharing with a PCIe NIC's traffic is not priced; e.g. [0,0.25,0.5,0.75] searches it.
    cpu_offloading: list[float] = field(default_factory=lambda: [0.0])
    top_k: int = 10  # how many runners-up the Plan keeps
    # Plans may leave devices idle, when nothing uses them all or fewer are faster (false: every device runs
    # a rank; an elastic launch sets it, as torchrun starts a worker on every device of every node).
    allow_idle: bool = True
    jobs: Optional[int] = None  # worker processes of the dp search (null: $NEST_MEGATRON_JOBS, else one per core)


@dataclass
class PlanChoice:
    """A configuration fixed by hand: scored by `evaluate`, a constraint for `plan`.

    Every field left None is free for `plan`; `evaluate` fills it with Megatron's default.
    """

    tp: Optional[int] = None  # tensor parallel size
    pp: Optional[int] = None  # pipeline parallel size
    dp: Optional[int] = None  # data parallel size
    cp: Optional[int] = None  # context parallel size
    ep: Optional[int] = None  # expert parallel size
    etp: Optional[int] = None  # expert tensor parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank
    sp: Optional[bool] = None  # sequence parallel
    mbs: Optional[int] = None  # micro-batch size
    zero: Optional[int] = None  # 0 DDP, 1 distributed optimizer, 2 / 3 Megatron-FSDP (optim_grads / optim_grads_params)
    recompute: Optional[str] = None  # none | selective | full
    recompute_num_layers: Optional[int] = None  # with full: the first n layers of each stage (null: all)
    # With selective: the modules recomputed (--recompute-modules), any of core_attn moe_act layernorm mla_up_proj
    # mlp moe shared_experts; null: `plan` chooses among a few sets (cost/recompute.py), `evaluate` takes
    # Megatron's default [core_attn].
    recompute_modules: Optional[list[str]] = None
    order: Optional[str] = None  # tp-cp-ep-dp-pp | tp-cp-ep-pp-dp
    cp_comm_type: Optional[str] = None  # --cp-comm-type with CP > 1: p2p (Megatron's default) | a2a | all_gather
    # --overlap-moe-expert-parallel-comm: a MoE layer's EP dispatch and combine of one micro-batch beside another's
    # computation in the schedule's steady state (cost/a2a_overlap.py); it needs EP > 1, virtual stages with PP > 1,
    # no full recompute and no recomputed moe module (parallel/rules.py)
    moe_a2a_overlap: Optional[bool] = None
    # --num-distributed-optimizer-instances: the data-parallel ranks as this many replicas of the sharded state, each
    # sharding it over dp x cp / instances ranks (its gradients reduce-scattered and weights gathered there, each
    # gradient shard all-reduced across the instances). Not searched: 1 unless given.
    distributed_optimizer_instances: Optional[int] = None
    # --cpu-offloading-num-layers: the activations the first n decoder layers save for backward are copied to host
    # memory during the forward and back before their backward (Transformer Engine's CPU offload; megatron-core takes it
    # with pp 1 and no recompute only). Device and host memory and copy time priced (cost/offload.py). Searched only
    # with solver.cpu_offloading (off by default): 0 unless given.
    cpu_offloading_num_layers: Optional[int] = None
    # --microbatch-group-size-per-virtual-pipeline-stage: with vpp > 1, the micro-batches each model chunk runs at a
    # time (from pp to all of them; null: pp, Megatron's default). More than pp holds more micro-batches' activations
    # in the warm-up (priced) and lets a batch that is no multiple of pp run interleaved. Unless given, `plan` takes
    # pp where pp divides the micro-batches, else the smallest group that runs them (solver/space.py microbatch_group).
    microbatch_group_size_per_vp_stage: Optional[int] = None
    # The layer split, given one of five ways (at most one; none: `evaluate` splits evenly, `plan` chooses). The
    # plan emits the simplest Megatron flags for the split it has, whichever way it was given.
    # layers_per_stage (needs plan.pp): pp entries, the layers of each pipeline rank (with vpp > 1 each a multiple
    # of vpp, split evenly over the rank's chunks), or pp*vpp entries, the layers of each model chunk in Megatron's
    # order (chunk k*pp + rank is the rank's k-th). Entries may be 0 (an empty stage, as Megatron's layout allows).
    layers_per_stage: Optional[list[int]] = None
    # --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding / the loss
    # counts as one layer, and the layers plus those split evenly over the pp*vpp chunks (the first chunk holds
    # one layer less with the embedding, the last one less with the loss): Llama 3.1 405B's 126 + 2 = 8 x 8 x 2.
    # None: not given (Megatron's default, false), so that only a given key counts as pinned.
    account_for_embedding_in_pipeline_split: Optional[bool] = None
    account_for_loss_in_pipeline_split: Optional[bool] = None
    # --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the first / last pipeline rank's
    # layers (a multiple of vpp); the other ranks share the rest evenly, each rank evenly over its chunks.
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    # --pipeline-model-parallel-layout (needs plan.pp): Megatron's layout string, its stages the pp*vpp chunks split
    # by '|': E the embedding, t a transformer layer, L the loss, m an MTP layer; 'X*n' and '(...)*n' repeat,
    # commas are cosmetic: 'Et|(t*2|)*62,tL'. Its stages set plan.vpp (stages / pp). Quote it for Hydra when it
    # has commas.
    pipeline_model_parallel_layout: Optional[str] = None
    # Which plan of the search to take: 0 the fastest, K >= 1 the K-th runner-up that fits (the Plan JSON's
    # runners_up rows that fit, in their order). None: the fastest for `plan`, `launch` and `sbatch`; for `evaluate`
    # the configuration the other keys give (with a pick, `evaluate` searches with them as pins and takes the pick).
    pick: Optional[int] = None


@dataclass
class ProfileConfig:
    """What `nest-megatron profile` measures, and whether `plan` uses what it measured."""

    warmup: int = 3  # untimed runs before each measurement
    repeats: int = 10  # timed runs; the median is kept
    # Devices a TP / EP group may span with real processes (torchrun): None = the visible GPUs
    # (1 on a CPU-only machine; 2 there launches two gloo processes). Wider groups are timed as
    # one rank's shard plus the modelled collective.
    local_devices: Optional[int] = None
    layers: bool = True  # also time whole megatron-core layers, not only their GEMMs / attention / memory ops
    use: bool = True  # plan and evaluate use the compute model fitted from the cache when it has profiles
    # price a GPU accelerator with profiles measured on a CPU: the CPU smoke run of the GPU validation, never a real plan
    allow_cpu: bool = False


@dataclass
class RootConfig:
    model: ModelConfig = MISSING
    accelerator: AcceleratorConfig = MISSING
    cluster: ClusterConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    plan: PlanChoice = field(default_factory=PlanChoice)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    out: Optional[str] = None  # where the Plan JSON is written
    report: Optional[str] = None  # `plan` also writes the explain report (index.html + PNGs) into this folder
    cache: Optional[str] = None  # the profile cache file (None: $XDG_CACHE_HOME/nest-megatron/profiles.json)
    calibration: Optional[str] = None  # a profile of nest-megatron calibrate that prices the plan (None: $NEST_MEGATRON_CALIBRATION, else the shipped constants)
