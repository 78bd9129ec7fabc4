"""Run one forward pass of a module (on the meta device) and record, per layer, what the cost model
needs: parameters, FLOPs by op class, collective bytes, bytes saved for backward, boundary bytes.

PyTorch's own tools do the counting: FlopCounterMode's per-op formulas (and its total, which the
per-layer sums are checked against), saved_tensors_hooks for what autograd keeps, ModuleTracker
for which module is running, and the ops' own tags (``torch.Tag.pointwise``) for elementwise work.
A "layer" is one of the given blocks; what runs before the first block is the ``embedding`` slot,
what runs after it the ``output`` slot.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from torch.utils.module_tracker import ModuleTracker

from nest_megatron.model.layer_graph import LayerTrace, TracedGemm

GEMM_OPS = {torch.ops.aten.mm, torch.ops.aten.addmm}  # an activation times a weight (nn.Linear)
# Products of two activations: attention scores and attention over values (megatron-core's
# unfused DotProductAttention uses baddbmm and bmm), and the fused kernels.
ATTENTION_OPS = {
    torch.ops.aten.bmm,
    torch.ops.aten.baddbmm,
    torch.ops.aten._scaled_dot_product_efficient_attention,
    torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_cudnn_attention,
    torch.ops.aten._flash_attention_forward,
    torch.ops.aten._efficient_attention_forward,
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass
class _Slot:
    """What one layer accumulates while the forward pass runs."""

    gemm_flops: float = 0.0
    attention_flops: float = 0.0
    elementwise_flops: float = 0.0
    communication_bytes: float = 0.0
    saved_bytes: float = 0.0
    boundary_bytes: float = 0.0
    gemms: list[TracedGemm] = field(default_factory=list)


def _nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return None


class _Recorder(TorchDispatchMode):
    """Attributes every aten op of the forward pass to the layer running it."""

    def __init__(self, tracker: ModuleTracker, slot_now: Callable[[], tuple[int, str]]):
        super().__init__()
        self.tracker, self.slot_now = tracker, slot_now
        self.slots: dict[int, _Slot] = defaultdict(_Slot)
        self.total_flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        index, prefix = self.slot_now()
        slot = self.slots[index]
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.total_flops += flops
            if packet in GEMM_OPS:
                slot.gemm_flops += flops
                a, b = (args[1], args[2]) if packet is torch.ops.aten.addmm else (args[0], args[1])
                slot.gemms.append(TracedGemm(self._module_name(prefix), a.shape[0], b.shape[1], a.shape[1]))
            else:
                slot.attention_flops += flops
        elif func.namespace in COLLECTIVE_NAMESPACES:
            slot.communication_bytes += max(_nbytes(t) for t in torch.utils._pytree.tree_leaves((args, out)))
        elif torch.Tag.pointwise in func.tags:
            slot.elementwise_flops += _first_tensor(out).numel()
        return out

    def _module_name(self, prefix: str) -> str:
        """The innermost module running, relative to the layer's own name."""
        inner = max((p for p in self.tracker.parents if p.startswith(prefix)), key=len, default=prefix)
        return inner[len(prefix):].lstrip(".") or "."


def record_layers(
    model: torch.nn.Module, run: Callable[[], object], blocks: list[tuple[str, str]]
) -> tuple[LayerTrace, ...]:
    """Trace `run()` (one forward pass of `model`); `blocks` lists (qualified name, kind) of the
    model's layers in execution order. Returns the embedding slot, one entry per block and the
    output slot, in that order."""
    root = type(model).__name__
    modules = dict(model.named_modules())
    block_names = [f"{root}.{name}" for name, _ in blocks]
    block_index = {name: i + 1 for i, name in enumerate(block_names)}
    last = len(blocks) + 1
    entered = [False]

    tracker = ModuleTracker()

    def slot_now() -> tuple[int, str]:
        for name in tracker.parents:
            if name in block_index:
                entered[0] = True
                return block_index[name], name
        return (last if entered[0] else 0), root

    recorder = _Recorder(tracker, slot_now)

    # Bytes saved for backward, one count per storage (a saved view keeps its whole storage alive),
    # owned by the layer that saves it first; parameters are model state, not activations.
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen_storages: set[int] = set()
    kept_alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen_storages:
            seen_storages.add(key)
            recorder.slots[slot_now()[0]].saved_bytes += t.untyped_storage().nbytes()
        kept_alive.append(t)  # so that no storage address is reused during the pass
        return t

    # Boundary: what each layer hands on (the embedding slot's is the first block's input).
    handles = []
    for i, (name, _) in enumerate(blocks):
        block = modules[name]
        if i == 0:
            handles.append(block.register_forward_pre_hook(
                lambda mod, args, kwargs: setattr(recorder.slots[0], "boundary_bytes",
                                                  _nbytes(_first_tensor((args, *kwargs.values())))),
                with_kwargs=True))
        handles.append(block.register_forward_hook(
            lambda mod, args, out, i=i: setattr(recorder.slots[i + 1], "boundary_bytes", _nbytes(_first_tensor(out)))))

    flop_counter = FlopCounterMode(display=False)
    try:
        with tracker, flop_counter, recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
    finally:
        for handle in handles:
            handle.remove()
    recorder.slots[last].boundary_bytes = _nbytes(_first_tensor(out))
    counted = flop_counter.get_total_flops()
    if counted != recorder.total_flops:
        raise RuntimeError(f"FLOPs attributed to layers ({recorder.total_flops}) != FlopCounterMode's total ({counted})")

    param_counts = _params_per_slot(model, blocks, modules)
    kinds = ["embedding"] + [kind for _, kind in blocks] + ["output"]
    names = [""] + [name for name, _ in blocks] + [""]
    return tuple(
        LayerTrace(
            index=i, kind=kinds[i], name=names[i],
            dense_params=param_counts[i][0], expert_params=param_counts[i][1],
            gemm_flops=s.gemm_flops, attention_flops=s.attention_flops, elementwise_flops=s.elementwise_flops,
            communication_bytes=s.communication_bytes, saved_bytes=s.saved_bytes, boundary_bytes=s.boundary_bytes,
            gemms=tuple(s.gemms),
        )
        for i, s in ((i, recorder.slots[i]) for i in range(last + 1))
    )


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (megatron-core: mlp.experts.*). Shared experts (mlp.shared_experts.*)
    are TP-split like a dense MLP and reduced over the DP group, so they count as dense."""
    return ".mlp.experts." in f".{name}"


def _params_per_slot(model, blocks, modules) -> list[tuple[int, int]]:
    """(dense, expert) parameters per slot: a block's own; outside the blocks, the parameters of
    modules defined before the first block (in registration order) go to the embedding slot, the
    rest to the output slot. Shared (tied) parameters are counted once, where first met."""
    counts = [[0, 0] for _ in range(len(blocks) + 2)]
    prefixes = [name + "." for name, _ in blocks]
    first_block = min(list(modules).index(name) for name, _ in blocks)
    order = {name: i for i, name in enumerate(modules)}
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        slot = next((i + 1 for i, prefix in enumerate(prefixes) if name.startswith(prefix)), None)
        if slot is None:
            slot = 0 if order.get(owner, len(order)) < first_block else len(blocks) + 1
        counts[slot][1 if is_expert_param(name) else 0] += p.numel()
    return [tuple(c) for c in counts]
