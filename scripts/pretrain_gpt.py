"""Train a small GPT with megatron-core, taking Megatron-LM's pretrain_gpt.py flag names.

Megatron-LM's own pretrain_gpt.py is not on PyPI (the megatron-core wheel holds megatron/core only),
so this is a short, real stand-in for examples and tests: megatron-core's GPTModel with the local
layer spec, its parallel_state, DistributedDataParallel or Megatron-FSDP (--use-megatron-fsdp, ZeRO-2/3),
Megatron optimizer and pipeline schedules. It runs under torchrun on CPU (gloo) and on GPUs (nccl):

    torchrun --standalone --nproc-per-node 2 scripts/pretrain_gpt.py \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 \\
        --tensor-model-parallel-size 2 --train-iters 10 --lr 3e-3

The data is synthetic and deterministic (repeating token cycles; every rank of a data-parallel
replica generates the same batch), so the loss falls within a few iterations. Flags of Megatron-LM
that this example does not implement are ignored with a note on stderr.

Log lines on stdout (rank 0 prints the arguments block and the next four; the last rank, which is on the last
pipeline stage, the rest; the loss is the mean over the micro-batches and data-parallel replicas). The arguments
block, the padded-vocabulary line, the iteration lines and (on GPUs) the memory reports are Megatron-LM's own
formats, so that `nest-megatron calibrate` reads this script's logs as it reads Megatron-LM's (the format strings
are cited where they are printed):
    ------------------------ arguments ------------------------
      add_bias_linear ................................. True
      ...
    -------------------- end of arguments ---------------------
     > padded vocab (size: 128) with 0 dummy tokens (new size: 128)
    pretrain_gpt parallel: world=4 tp=2 pp=1 dp=2 cp=1 ep=1 etp=2 vpp=1 order=tp-cp-ep-dp-pp
    pretrain_gpt plan: num_microbatches=2 layers_per_stage=[2] vocab=256 device=cpu
    pretrain_gpt wrap: DistributedDataParallel   (Megatron-FSDP: FullyShardedDataParallel optim_grads_params)
     [2026-12-02 03:00:00.000000] iteration        1/      10 | consumed samples:            8 | elapsed time per
       iteration (ms): 41.0 | learning rate: 3.000000E-03 | global batch size:     8 | lm loss: 5.553990E+00 |
       loss scale: 1.0 | grad norm: 2.612 | number of skipped iterations:   0 | number of nan iterations:   0 |
    ...
    pretrain_gpt done: iterations=10 first_loss=5.553990 last_loss=3.487909
(one line each; an fp16 step skipped for a loss-scale overflow prints no grad norm and counts as a skipped iteration).

With --save DIR --save-interval N it writes a torch_dist checkpoint (megatron-core's dist_checkpointing, Megatron-LM's
layout: DIR/iter_NNNNNNN and DIR/latest_checkpointed_iteration.txt) every N iterations; --load DIR resumes from
the latest one, under any TP / PP / DP (the vocabulary must pad to the same size), and trains on to --train-iters:
    pretrain_gpt loaded checkpoint: iteration=10 dir=DIR/iter_0000010
    iteration 11/20 | lm loss: ...

With NEST_DUMP_GROUPS=DIR each rank writes DIR/rank<global rank>.json: its TP, PP, DP, CP, EP
groups as megatron-core built them (global ranks), its host, node rank, local rank and the
CUDA_VISIBLE_DEVICES it sees. With --train-iters 0 it stops after that.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import socket
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

PREFIX = "pretrain_gpt"
USAGE_ERROR = 2


def fail(message: str) -> None:
    """One line naming what is wrong (once per node), exit 2. Every rank sees the same arguments, so
    every rank exits, before any process group exists."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"{PREFIX}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_ERROR)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        fail(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog=PREFIX, allow_abbrev=False)
    model = p.add_argument_group("model (Megatron-LM names)")
    model.add_argument("--num-layers", type=int, required=True)
    model.add_argument("--hidden-size", type=int, required=True)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    model.add_argument("--num-attention-heads", type=int, required=True)
    model.add_argument("--group-query-attention", action="store_true")
    model.add_argument("--num-query-groups", type=int, default=None)
    model.add_argument("--kv-channels", type=int, default=None)
    model.add_argument("--seq-length", type=int, required=True)
    model.add_argument("--max-position-embeddings", type=int, default=None)
    model.add_argument("--vocab-size", type=int, default=128,
                       help="the tokenizer's size, as Megatron-LM's NullTokenizer reads it")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    model.add_argument("--padded-vocab-size", type=int, default=None, help="the embedding's rows, as given")
    model.add_argument("--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"])
    model.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    model.add_argument("--swiglu", action="store_true")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--disable-bias-linear", action="store_true")
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--num-experts", type=int, default=None)
    model.add_argument("--moe-router-topk", type=int, default=2)
    model.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    model.add_argument("--moe-layer-freq", type=int, default=1)
    model.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall", "flex"],
                       help="used on GPUs; on CPU always allgather (megatron-core's alltoall needs CUDA)")

    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--expert-model-parallel-size", type=int, default=1)
    par.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    par.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    par.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    par.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    par.add_argument("--pipeline-model-parallel-layout", default=None)
    par.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    par.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    par.add_argument("--use-tp-pp-dp-mapping", action="store_true")
    par.add_argument("--use-distributed-optimizer", action="store_true")
    par.add_argument("--overlap-grad-reduce", action="store_true")
    par.add_argument("--overlap-param-gather", action="store_true")
    par.add_argument("--use-megatron-fsdp", action="store_true")
    par.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                     choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    par.add_argument("--init-model-with-meta-device", action="store_true")
    par.add_argument("--ckpt-format", default="torch_dist", help="--save/--load read and write torch_dist only")

    ckpt = p.add_argument_group("checkpointing (Megatron-LM's layout: DIR/iter_NNNNNNN, DIR/latest_checkpointed_iteration.txt)")
    ckpt.add_argument("--save", default=None, help="write a torch_dist checkpoint here every --save-interval iterations")
    ckpt.add_argument("--load", default=None, help="resume from the latest checkpoint here (none yet: start from scratch)")
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                      help="the distributed optimizer's state saved reshardable across TP / PP too (else DP only)")

    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, required=True)
    train.add_argument("--global-batch-size", type=int, default=None, help="default micro batch x data parallel")
    train.add_argument("--train-iters", type=int, default=10)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--lr-decay-style", default="constant", choices=["constant", "linear", "cosine"])
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--bf16", action="store_true")
    train.add_argument("--fp16", action="store_true")
    train.add_argument("--loss-scale", type=float, default=None, help="fp16: a fixed loss scale (default: dynamic)")
    train.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    train.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    train.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    train.add_argument("--recompute-num-layers", type=int, default=None)
    train.add_argument("--log-interval", type=int, default=1)

    args, unknown = p.parse_known_args(argv)
    if unknown:
        note(f"ignoring flags this example does not implement: {' '.join(unknown)}")
    return args


def note(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{PREFIX}: note: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Megatron-LM's log formats (megatron/training at d98e8a6), which nest-megatron calibrate reads
# ---------------------------------------------------------------------------------------------
def megatron_namespace(args, world: int) -> dict:
    """The parsed arguments as Megatron-LM's validated namespace names them: its attribute for each flag
    (--disable-bias-linear sets add_bias_linear False: core/transformer/transformer_config.py:212-214) and what
    validate_args derives (world_size, data_parallel_size, virtual_pipeline_model_parallel_size: arguments.py:145,
    448, 941-983); transformer_impl is the layer spec it builds."""
    namespace = {k: v for k, v in vars(args).items() if k not in ("disable_bias_linear", "virtual_stages")}
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    # It builds megatron-core's local layer spec (build_chunks): Megatron-LM's --transformer-impl local.
    namespace.update(add_bias_linear=not args.disable_bias_linear, world_size=world, rank=0, transformer_impl="local",
                     data_parallel_size=world // model_parallel,
                     virtual_pipeline_model_parallel_size=args.virtual_stages)
    return namespace


def print_arguments(args, world: int) -> None:
    """Megatron-LM's arguments block: megatron/training/arguments.py:1990-2001 `_print_args` ("arguments")."""
    title, namespace = "arguments", megatron_namespace(args, world)
    print(f'------------------------ {title} ------------------------', flush=True)
    str_list = []
    for arg in namespace:
        dots = '.' * (48 - len(arg))
        str_list.append('  {} {} {}'.format(arg, dots, namespace[arg]))
    for arg in sorted(str_list, key=lambda x: x.lower()):
        print(arg, flush=True)
    print(f'-------------------- end of {title} ---------------------', flush=True)


def print_padded_vocab(vocab_size: int, padded_size: int) -> None:
    """megatron/training/vocab_utils.py:35-39 (calculate_padded_vocab_size)."""
    print(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
        vocab_size, padded_size - vocab_size, padded_size), flush=True)


def iteration_line(*, iteration: int, train_iters: int, consumed: int, elapsed_s: float, learning_rate: float,
                   batch_size: int, loss: float, loss_scale: float, grad_norm: float | None, skipped: int) -> str:
    """megatron/training/training.py:3567-3641 `training_log`, the fields this script has (no throughput:
    --log-throughput is Megatron-LM's option), in its order."""
    log_string = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(consumed)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_s * 1000.0)
    log_string += f' learning rate: {learning_rate:.6E} |'
    log_string += f' global batch size: {batch_size:5d} |'
    log_string += ' {}: {:.6E} |'.format("lm loss", loss)
    log_string += f' loss scale: {loss_scale:.1f} |'
    if grad_norm is not None:
        log_string += f' grad norm: {grad_norm:.3f} |'
    log_string += ' number of skipped iterations: {:3d} |'.format(skipped)
    log_string += ' number of nan iterations: {:3d} |'.format(0)
    return log_string


def report_memory(name: str) -> None:
    """megatron/training/utils/common_utils.py:313-334 `report_memory`, printed by data-parallel rank 0 on GPUs."""
    mega_bytes = 1024.0 * 1024.0
    string = name + ' memory (MB)'
    string += f" | allocated: {torch.cuda.memory_allocated() / mega_bytes:.2f}"
    string += f" | max allocated: {torch.cuda.max_memory_allocated() / mega_bytes:.2f}"
    string += f" | reserved: {torch.cuda.memory_reserved() / mega_bytes:.2f}"
    string += f" | max reserved: {torch.cuda.max_memory_reserved() / mega_bytes:.2f}"
    print("[Rank {}] {}".format(torch.distributed.get_rank(), string), flush=True)


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------
def virtual_stages(args) -> int | None:
    if args.num_virtual_stages_per_pipeline_rank and args.num_layers_per_virtual_pipeline_stage:
        fail("--num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage are exclusive")
    if args.num_virtual_stages_per_pipeline_rank:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage:
        # the embedding and the loss each count as a layer of the split when accounted for (transformer_block.py)
        counted = (args.num_layers + args.account_for_embedding_in_pipeline_split
                   + args.account_for_loss_in_pipeline_split)
        per_rank = counted // args.pipeline_model_parallel_size
        if per_rank % args.num_layers_per_virtual_pipeline_stage:
            fail(f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} must divide "
                 f"the {per_rank} layers of each pipeline rank")
        return per_rank // args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_model_parallel_layout:  # as Megatron-LM: one stage per '|'-part, pp of them per round
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        try:
            stages = len(PipelineParallelLayerLayout.parse_str_to_list(args.pipeline_model_parallel_layout))
        except Exception as err:  # megatron-core's parser asserts
            fail(f"--pipeline-model-parallel-layout {args.pipeline_model_parallel_layout!r} is not a layout "
                 f"(stages of E, t, L separated by '|', e.g. 'Et*3|t*1L'): {err}")
        if stages % args.pipeline_model_parallel_size:
            fail(f"--pipeline-model-parallel-layout has {stages} stages, not a multiple of "
                 f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
        vpp = stages // args.pipeline_model_parallel_size
        return vpp if vpp > 1 else None
    return None


def check_sizes(args) -> None:
    """What Megatron-LM's validate_args checks of the sizes, before any process group exists."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if world % model_parallel:
        fail(f"world size {world} is not a multiple of tensor x pipeline x context parallel = {model_parallel}")
    data_parallel = world // model_parallel
    args.virtual_stages = virtual_stages(args)
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * data_parallel
    if args.global_batch_size % (args.micro_batch_size * data_parallel):
        fail(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
             f"{args.micro_batch_size} x data parallel {data_parallel}")
    if args.use_megatron_fsdp:
        # Megatron-LM: validate_args (arguments.py:1169, 1183); mcore_fsdp_adapter._get_dp_tp_mesh has no
        # pipeline dimension (Megatron-LM issue #1455): einops refuses the world of a pipelined run.
        if args.ckpt_format != "fsdp_dtensor":
            fail("--use-megatron-fsdp needs --ckpt-format fsdp_dtensor")
        if args.pipeline_model_parallel_size > 1:
            fail(f"--use-megatron-fsdp with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
                 "Megatron-FSDP's device mesh has no pipeline dimension; use 1")
        if args.init_model_with_meta_device and args.data_parallel_sharding_strategy == "no_shard":
            fail("--init-model-with-meta-device with --data-parallel-sharding-strategy no_shard: not supported")
        args.use_distributed_optimizer = True  # as validate_args: Megatron-FSDP v1 runs with the distributed optimizer
    if (args.save or args.load) and (args.ckpt_format != "torch_dist" or args.use_megatron_fsdp):
        fail(f"--save / --load with --ckpt-format {args.ckpt_format}"
             f"{' and --use-megatron-fsdp' if args.use_megatron_fsdp else ''}: this example checkpoints torch_dist "
             "only (DDP or the distributed optimizer)")
    if args.save and not args.save_interval:
        fail("--save needs --save-interval N (iterations between checkpoints)")


def init_distributed(args, use_cuda: bool) -> None:
    from megatron.core import parallel_state as ps

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if "RANK" not in os.environ:  # plain `python pretrain_gpt.py`: a one-rank job
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_stages,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def built_sizes() -> dict[str, int]:
    """The parallel sizes megatron-core built, read back from parallel_state."""
    from megatron.core import parallel_state as ps

    return {
        "world": dist.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }


def group_ranks() -> dict[str, list[int]]:
    """This rank's groups, as the global ranks megatron-core put in them."""
    from megatron.core import parallel_state as ps

    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "cp": ps.get_context_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
    }
    return {name: dist.get_process_group_ranks(group) for name, group in groups.items()}


def dump_groups(directory: str, device: str) -> None:
    record = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's --node-rank of this agent
        "hostname": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "device": device,
        "sizes": built_sizes(),
        "groups": group_ranks(),
    }
    path = Path(directory) / f"rank{record['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def padded_vocab(args) -> int:
    """--padded-vocab-size as given, else Megatron-LM pads the vocabulary to a multiple of
    make_vocab_size_divisible_by x TP (megatron/training/argument_utils.py:474-476)."""
    if args.padded_vocab_size is not None:
        return args.padded_vocab_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return math.ceil(args.vocab_size / multiple) * multiple


def dispatcher(args, use_cuda: bool) -> str:
    """The MoE token dispatcher: the one asked for on GPUs; on CPU allgather, the one megatron-core runs there."""
    if use_cuda or args.num_experts is None or args.moe_token_dispatcher_type == "allgather":
        return args.moe_token_dispatcher_type
    note(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type}: runs on GPUs only; allgather on CPU")
    return "allgather"


def transformer_config(args, use_cuda: bool, vpp: int | None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    num_query_groups = args.num_query_groups if args.group_query_attention else None
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        add_bias_linear=not args.disable_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        normalization=args.normalization,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq,
        moe_token_dispatcher_type=dispatcher(args, use_cuda),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Fused kernels need Apex / Transformer Engine, which the megatron-core wheel does not bring.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        use_cpu_initialization=not use_cuda,
        init_model_with_meta_device=args.init_model_with_meta_device,
        # As Megatron-LM sets it: a stage frees its output's data once sent, which the memory model assumes.
        deallocate_pipeline_outputs=True,
    )


def build_chunks(args, config, vocab: int) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage of this rank (one without virtual stages)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if args.num_experts:  # megatron-core's MoE router without Transformer Engine: see there
        from nest_megatron.trace.cpu_megatron import bind_missing_te_gemm

        bind_missing_te_gemm()
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, normalization=args.normalization)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    # Megatron-LM's get_model: with --init-model-with-meta-device the model is built without memory.
    device = torch.device("meta") if args.init_model_with_meta_device else contextlib.nullcontext()
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        with device:
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=vocab,
                max_sequence_length=args.max_position_embeddings or args.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                position_embedding_type=args.position_embedding_type,
                vp_stage=stage,
            )
        chunks.append(chunk)
    return chunks


def wrap_for_training(args, config, chunks, use_cuda: bool):
    """Mixed precision and Megatron's DistributedDataParallel or Megatron-FSDP, as Megatron-LM's get_model does
    (a model built on the meta device stays there until Megatron-FSDP materialises this rank's shard). On CPU,
    Megatron-FSDP runs on gloo with `enter_cpu_fsdp`'s stand-ins for its CUDA streams and events."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    if use_cuda and not args.init_model_with_meta_device:
        chunks = [chunk.cuda() for chunk in chunks]
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce and use_cuda,
        overlap_param_gather=args.overlap_param_gather and use_cuda,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy if args.use_megatron_fsdp else "no_shard",
        gradient_reduce_div_fusion=use_cuda,  # fused into NCCL's PREMUL_SUM, which gloo lacks
    )
    if args.use_megatron_fsdp:
        # get_model passes the mpu's process groups; the device is the one this rank trains on.
        device = torch.device(f"cuda:{torch.cuda.current_device()}") if use_cuda else torch.device("cpu")
        with contextlib.nullcontext() if use_cuda else cuda_index_zero():
            return [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                             disable_bucketing=index > 0, device=device,
                                             pg_collection=ProcessGroupCollection.use_mpu_process_groups())
                    for index, chunk in enumerate(chunks)]
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


class CudaTargetsToCpu(torch.overrides.TorchFunctionMode):
    """`Tensor.to("cuda")`, as Megatron-FSDP's DTensors on its (hard-coded) "cuda" device mesh ask, stays on the
    CPU; `Tensor.record_stream` (for a CUDA caching allocator) does nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to and len(args) > 1 and str(args[1]).startswith("cuda"):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **(kwargs or {}))


class CpuEvent:
    """A CUDA event on the CPU: everything recorded has already run."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuStream:
    """A CUDA stream on the CPU: work runs in order, nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> CpuEvent:
        return event or CpuEvent()

    def synchronize(self) -> None:
        pass


def enter_cpu_fsdp() -> None:
    """Megatron-FSDP's streams and events, on the CPU, for the rest of the process (after enter_cpu_training)."""
    torch.cuda.Stream, torch.cuda.Event = CpuStream, CpuEvent
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *args, **kwargs: CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    CudaTargetsToCpu().__enter__()  # never exited, as CudaToCpu


@contextlib.contextmanager
def cuda_index_zero():
    """On CPU, while Megatron-FSDP is set up, torch.cuda.current_device() answers 0: it spells devices
    f"cuda:{index}" (CudaToCpu sends those to the CPU); elsewhere the CPU patches answer the CPU device."""
    current = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.current_device = current


def layers_per_stage(chunks, group, device: str) -> list[int]:
    """Transformer layers built on each rank of the pipeline `group` (summed over its virtual stages).
    The count travels on `device`: NCCL, the GPU run's backend, serves CUDA tensors only."""
    mine = torch.tensor([sum(len(unwrap(c).decoder.layers) for c in chunks)], device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(t) for t in every]


def unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


# ---------------------------------------------------------------------------------------------
# Data: repeating cycles, a pattern a tiny GPT learns in a few steps
# ---------------------------------------------------------------------------------------------
CYCLE = 8  # tokens in one cycle


def micro_batches(args, vocab_size: int, device: str, num_microbatches: int, start: int = 0):
    """Endless micro-batches for this rank's data-parallel replica, from iteration `start` on (a resume).

    Each sequence repeats a cycle of CYCLE distinct tokens with a random phase; the generator is
    seeded by (seed, iteration, dp rank), so every rank of one replica (its TP, CP and PP ranks)
    sees the same batch without any broadcast, and each replica sees different data.
    """
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank()
    cycles = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(args.seed))[: 4 * CYCLE].view(4, CYCLE)
    positions = torch.arange(args.seq_length + 1)
    iteration = start
    while True:
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + iteration * 1009 + dp_rank)
        for _ in range(num_microbatches):
            which = torch.randint(0, len(cycles), (args.micro_batch_size,), generator=gen)
            phase = torch.randint(0, CYCLE, (args.micro_batch_size, 1), generator=gen)
            tokens = cycles[which[:, None], (positions[None, :] + phase) % CYCLE]
            yield {
                "tokens": tokens[:, :-1].contiguous().to(device),
                "labels": tokens[:, 1:].contiguous().to(device),
                "position_ids": positions[:-1].expand(args.micro_batch_size, -1).contiguous().to(device),
            }
        iteration += 1


def loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    # A copy: the schedule divides the returned loss by the number of micro-batches in place.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


# ---------------------------------------------------------------------------------------------
# Checkpoints: megatron-core's dist_checkpointing (torch_dist), as Megatron-LM's training/checkpointing.py
# ---------------------------------------------------------------------------------------------
TRACKER = "latest_checkpointed_iteration.txt"


def sharded_metadata(args) -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata: how the distributed optimizer lays out its state
    (dp_reshardable reshards across DP only; fully_reshardable across TP and PP too)."""
    from megatron.core import parallel_state as ps

    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = ("fully_reshardable" if args.dist_ckpt_optim_fully_reshardable
                                                   else "dp_reshardable")
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def sharded_state(args, chunks, optimizer, *, loading: bool) -> dict:
    """Megatron-LM's generate_state_dict for torch_dist: each chunk's ShardedTensors (global shapes and offsets,
    so that another TP / PP / DP layout reads them; of the model inside the DDP and fp16 wrappers, as Megatron-LM's
    unwrap_model) and the optimizer state mapped onto them."""
    metadata = sharded_metadata(args)
    state = {"model" if len(chunks) == 1 else f"model{i}": unwrap(chunk).sharded_state_dict(metadata=metadata)
             for i, chunk in enumerate(chunks)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def save_checkpoint(args, iteration: int, chunks, optimizer, scheduler) -> None:
    from megatron.core import dist_checkpointing

    directory = Path(args.save) / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = sharded_state(args, chunks, optimizer, loading=False)
    state.update(iteration=iteration, opt_param_scheduler=scheduler.state_dict(), checkpoint_version=3.0)
    dist_checkpointing.save(state, str(directory))
    dist.barrier()  # every rank has written its shards: only now is the checkpoint the latest
    if dist.get_rank() == 0:
        tmp = Path(args.save) / f"{TRACKER}.tmp"
        tmp.write_text(str(iteration))
        tmp.replace(Path(args.save) / TRACKER)
        print(f"{PREFIX} saved checkpoint: iteration={iteration} dir={directory}", flush=True)


def load_checkpoint(args, chunks, optimizer, scheduler) -> int:
    """The iteration of the latest checkpoint under --load, its model, optimizer and scheduler state loaded
    into this layout; 0 when there is none yet (as Megatron-LM: a fresh start)."""
    from megatron.core import dist_checkpointing

    tracker = Path(args.load) / TRACKER
    if not tracker.is_file():
        if dist.get_rank() == 0:
            print(f"{PREFIX} no checkpoint in {args.load}: training from scratch", flush=True)
        return 0
    iteration = int(tracker.read_text().strip())
    directory = Path(args.load) / f"iter_{iteration:07d}"
    state = dist_checkpointing.load(sharded_state(args, chunks, optimizer, loading=True), str(directory))
    for i, chunk in enumerate(chunks):
        unwrap(chunk).load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if dist.get_rank() == 0:
        print(f"{PREFIX} loaded checkpoint: iteration={state['iteration']} dir={directory}", flush=True)
    return int(state["iteration"])


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def train(args, use_cuda: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = "cuda" if use_cuda else "cpu"
    num_microbatches = args.global_batch_size // (args.micro_batch_size * ps.get_data_parallel_world_size())

    config = transformer_config(args, use_cuda, ps.get_virtual_pipeline_model_parallel_world_size())
    vocab = padded_vocab(args)
    chunks = wrap_for_training(args, config, build_chunks(args, config, vocab), use_cuda)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce and use_cuda:
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync
    split = layers_per_stage(chunks, ps.get_pipeline_model_parallel_group(), device)
    if dist.get_rank() == 0:
        if args.padded_vocab_size is None:  # Megatron prints it only where it pads
            print_padded_vocab(args.vocab_size, vocab)
        print(f"{PREFIX} plan: num_microbatches={num_microbatches} layers_per_stage={split} vocab={vocab} "
              f"device={device}", flush=True)
        sharding = f" {args.data_parallel_sharding_strategy}" if args.use_megatron_fsdp else ""
        print(f"{PREFIX} wrap: {type(chunks[0]).__name__}{sharding}", flush=True)

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, clip_grad=args.clip_grad,
            bf16=args.bf16, fp16=args.fp16, params_dtype=config.params_dtype,
            loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        chunks,
    )
    config.grad_scale_func = optimizer.scale_loss  # the schedules scale the loss before backward (fp16)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=max(args.train_iters, 1),
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=max(args.train_iters, 1), wd_incr_style="constant",
    )
    resumed = load_checkpoint(args, chunks, optimizer, scheduler) if args.load else 0
    data = micro_batches(args, args.vocab_size, device, num_microbatches, resumed)
    iterators = [data] * len(chunks) if len(chunks) > 1 else data
    forward_backward = get_forward_backward_func()
    is_logger = dist.get_rank() == dist.get_world_size() - 1  # all coordinates maximal: a last-stage rank
    first_loss = last_loss = float("nan")
    interval_start, interval_iterations, skipped = time.perf_counter(), 0, 0
    for iteration in range(resumed + 1, args.train_iters + 1):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        updated, grad_norm, _ = optimizer.step()  # fp16: not updated while the loss scale overflows
        scheduler.step(increment=1)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss = torch.stack([entry["lm loss"] for entry in losses]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
            last_loss = loss.item() / ps.get_data_parallel_world_size(with_context_parallel=True)
            first_loss = last_loss if iteration == resumed + 1 else first_loss
        if use_cuda:  # CUDA kernels run asynchronously: the iteration ends when this rank's have run
            torch.cuda.synchronize()
        interval_iterations += 1
        skipped += not updated
        # As Megatron-LM's training_log: a line after the first iteration (it shows the start-up) and every
        # --log-interval, with the mean time of the iterations since the previous line (training.py:3538-3548).
        if iteration % args.log_interval == 0 or iteration == resumed + 1 or iteration == args.train_iters:
            elapsed_s = (time.perf_counter() - interval_start) / interval_iterations
            if is_logger:
                print(iteration_line(iteration=iteration, train_iters=args.train_iters,
                                     consumed=iteration * args.global_batch_size, elapsed_s=elapsed_s,
                                     learning_rate=optimizer.param_groups[0]["lr"], batch_size=args.global_batch_size,
                                     loss=last_loss, loss_scale=optimizer.get_loss_scale().item(),
                                     grad_norm=grad_norm if updated else None, skipped=skipped), flush=True)
            if use_cuda and iteration <= resumed + 2 and ps.get_data_parallel_rank() == 0:
                report_memory(f"(after {iteration} iterations)")  # training.py:3679-3692: the first two
            interval_start, interval_iterations, skipped = time.perf_counter(), 0, 0
        if args.save and iteration % args.save_interval == 0:
            save_checkpoint(args, iteration, chunks, optimizer, scheduler)
    if is_logger:
        print(f"{PREFIX} done: iterations={args.train_iters - resumed} first_loss={first_loss:.6f} last_loss={last_loss:.6f}",
              flush=True)


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*")  # TransformerConfig's own default
    use_cuda = torch.cuda.is_available()
    if not use_cuda:  # first: its fused kernels never run here (every fusion is off, transformer_config below)
        from nest_megatron.trace.cpu_megatron import import_megatron_core_uncompiled

        import_megatron_core_uncompiled()
    args = parse_args(argv)
    if args.group_query_attention and not args.num_query_groups:
        fail("--group-query-attention needs --num-query-groups")
    if args.bf16 and args.fp16:
        fail("--bf16 and --fp16 are exclusive")
    if args.sequence_parallel and (args.tensor_model_parallel_size == 1 or importlib.util.find_spec("apex") is None):
        # Megatron-LM turns it off at TP=1 too; without Apex the local spec's torch norms assert on it.
        note("--sequence-parallel dropped: it needs TP > 1 and, with the local layer spec, Apex's norms")
        args.sequence_parallel = False
    check_sizes(args)
    if args.init_model_with_meta_device and not (use_cuda and args.use_megatron_fsdp):
        # Megatron-FSDP materialises the model; on CPU, CPU initialisation puts megatron-core's own layers on the
        # meta device too, and they have no reset_parameters to materialise them with (on GPUs they allocate there).
        note("--init-model-with-meta-device dropped: used with --use-megatron-fsdp on GPUs only")
        args.init_model_with_meta_device = False
    if int(os.environ.get("RANK", "0")) == 0:
        print_arguments(args, int(os.environ.get("WORLD_SIZE", "1")))
    init_distributed(args, use_cuda)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (CPU initialisation)
    if use_cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)  # megatron's CUDA RNG tracker: per-TP-rank dropout streams
    else:
        from nest_megatron.launch.cpu_runtime import enter_cpu_training

        enter_cpu_training()
        if args.use_megatron_fsdp:
            enter_cpu_fsdp()
    if dist.get_rank() == 0:
        print(f"{PREFIX} parallel: " + " ".join(f"{k}={v}" for k, v in built_sizes().items())
              + f" order={'tp-cp-ep-pp-dp' if args.use_tp_pp_dp_mapping else 'tp-cp-ep-dp-pp'}", flush=True)
    if os.environ.get("NEST_DUMP_GROUPS"):
        dump_groups(os.environ["NEST_DUMP_GROUPS"], "cuda" if use_cuda else "cpu")
    if args.train_iters > 0:
        train(args, use_cuda)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
