"""Train with megatron-core on CPU (gloo): what scripts/pretrain_gpt.py needs beyond
nest_megatron.trace.cpu_megatron, which makes single layers run on CPU.

Training adds megatron-core's pipeline schedules, p2p communication, DDP buffers and optimizer,
which allocate with a hard-coded ``device="cuda"`` or call ``Tensor.cuda()``. A TorchFunctionMode
sends those to the CPU instead of patching each call site. Used only when no GPU is visible.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from nest_megatron.trace.cpu_megatron import prepare_cpu_megatron


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class CudaToCpu(TorchFunctionMode):
    """Every torch call asked to put a tensor on CUDA puts it on the CPU.

    Patch A: factory calls with ``device="cuda"`` (schedules.py: ``total_num_tokens =
    torch.zeros([], device="cuda")``; the grad scaler's and the optimizer's counters).
    Patch B: ``Tensor.cuda()`` returns the tensor itself (LanguageModule moves the tied
    word-embedding copy with ``weight.data.cuda()`` before all-reducing it across the first and
    last pipeline stages).
    Patch D: ``Tensor.type()`` names a CPU tensor as the CUDA type of its dtype
    ("torch.cuda.FloatTensor"): megatron's optimizers sort parameters and check gradients by
    those names (``param.type() == 'torch.cuda.FloatTensor'`` in optimizer.py, distrib_optimizer.py
    and clip_grads.py), and under Patch A every tensor that would be on CUDA is on the CPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def enter_cpu_training() -> None:
    """Make this process train megatron-core models on CPU, for the rest of its life.

    Call after ``torch.distributed.init_process_group("gloo")`` and
    ``parallel_state.initialize_model_parallel(...)``: prepare_cpu_megatron would otherwise set up
    a one-rank group of its own.
    """
    prepare_cpu_megatron()
    # Patch C: p2p_communication calls torch.cuda.synchronize() after batched isend/irecv; there
    # is nothing to synchronise on CPU (gloo's wait() has already completed the transfer).
    torch.cuda.synchronize = lambda *args, **kwargs: None
    CudaToCpu().__enter__()  # never exited: the whole training runs under it
