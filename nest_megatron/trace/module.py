"""Any torch.nn.Module -> layer graph: the model a factory `pkg.mod:function` builds, traced over
its top-level repeated blocks (the largest ModuleList / Sequential of same-class children).

The factory is called inside `with torch.device("meta")` (parameters take no memory) and returns
the module, or (module, example input); the default input is one sequence of token ids, [1, s].
A generic module has no tensor-parallel form: it is traced at TP = EP = 1 only.
"""

from __future__ import annotations

import importlib

from nest_megatron.errors import NestError
from nest_megatron.model.layer_graph import LayerGraph


def load_factory(spec: str):
    """The callable `pkg.mod:function` names; one line when it does not exist."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise NestError(f"model.module={spec}: expected pkg.mod:factory (a module path, a colon, a function name)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise NestError(f"model.module={spec}: cannot import {module_name} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise NestError(f"model.module={spec}: {module_name} has no callable {attr}")
    return factory


def repeated_blocks(model) -> str:
    """Qualified name of the container of the model's repeated blocks."""
    import torch

    best, best_params = None, -1
    for name, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for p in container.parameters())
        if params > best_params:
            best, best_params = name, params
    if best is None:
        raise NestError(f"{type(model).__name__}: no ModuleList or Sequential of two or more same-class blocks to trace")
    return best


def trace_module(spec: str, *, seq_length: int, name: str | None = None) -> LayerGraph:
    """The layer graph of one forward pass of the module the factory `spec` builds."""
    import torch

    from nest_megatron.trace.record import record_layers

    with torch.device("meta"):
        built = load_factory(spec)()
        model, example = built if isinstance(built, tuple) else (built, torch.zeros(1, seq_length, dtype=torch.long))
    if not isinstance(model, torch.nn.Module):
        raise NestError(f"model.module={spec}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    model.train()
    args = example if isinstance(example, tuple) else (example,)
    container = repeated_blocks(model)
    blocks = [(f"{container}.{i}" if container else str(i), "block") for i in range(len(model.get_submodule(container)))]

    def run():
        with torch.device("meta"):
            return model(*args)

    layers = record_layers(model, run, blocks)
    # The example's batch and sequence: [b, s, ...] or [s]; the cost model scales by tokens = b s.
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    batch, seq = (first.shape[0], first.shape[1]) if first is not None and first.dim() > 1 else (1, seq_length)
    return LayerGraph(source="module", model=name or spec, seq_length=seq, micro_batch_size=batch,
                      tp=1, ep=1, etp=1, layers=layers)
