"""The layer graph a trace produces: per layer of one rank, its parameters, forward FLOPs by op
class, activation bytes saved for backward and the tensor it hands to the next layer.

One graph describes one parallel shape (tp, ep, etp, sequence parallel or not) at one micro-batch
of one sequence, without context parallelism; the cost model scales it (model/spec.py,
cost/activations.py).
It lives in the model layer because the cost model reads it; nest_megatron/trace/ produces it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from nest_megatron.errors import NestError
from nest_megatron.model.kinds import is_kind_label

SCHEMA_VERSION = 1
# embedding and output: what runs before and after the layers; block: a repeated module of any nn.Module;
# a transformer layer is named by its kind (model/kinds.py LayerKind.label: dense, moe, mla+moe, mtp:moe, ...).
SLOT_KINDS = ("embedding", "output", "block")


@dataclass(frozen=True)
class TracedGemm:
    """One matrix product with a weight, [m, k] @ [k, n]; m is proportional to the tokens."""

    name: str  # the module that ran it, relative to its layer (e.g. self_attention.linear_qkv)
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class LayerTrace:
    index: int  # position in the graph
    kind: str  # one of SLOT_KINDS or a LayerKind.label
    name: str  # the module's qualified name in the traced model
    dense_params: int  # on this rank; reduced over the data-parallel group
    expert_params: int  # routed-expert parameters on this rank; reduced over expert-data-parallel
    gemm_flops: float  # forward; products of an activation with a weight
    attention_flops: float  # forward; products of two activations (scores, attention over values)
    elementwise_flops: float  # forward; one per output element of every pointwise op
    communication_bytes: float  # forward; bytes of every collective's buffer on this rank
    saved_bytes: float  # bytes autograd keeps for backward (storages, parameters excluded)
    boundary_bytes: float  # the layer's output tensor
    gemms: tuple[TracedGemm, ...] = field(default=())
    # Of saved_bytes, what does not grow with the micro-batch (an [s, s] causal mask, RoPE's cos and
    # sin), from a second trace at twice the micro-batch; 0 when not measured.
    fixed_saved_bytes: float = 0.0

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


@dataclass(frozen=True)
class LayerGraph:
    source: str  # megatron | hf | module
    model: str  # the model's name
    seq_length: int
    micro_batch_size: int
    tp: int
    ep: int
    etp: int
    layers: tuple[LayerTrace, ...]
    sequence_parallel: bool = False  # tensors on the full hidden size sharded over TP along the sequence
    pp: int = 1  # pipeline stages; this graph holds stage `stage`'s layers
    stage: int = 0

    @property
    def tokens(self) -> int:
        return self.seq_length * self.micro_batch_size

    def first_of_kind(self, kind: str) -> LayerTrace | None:
        return next((layer for layer in self.layers if layer.kind == kind), None)

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> LayerGraph:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise NestError(f"layer graph schema_version={version}: this nest-megatron reads version {SCHEMA_VERSION}")
        try:
            layers = tuple(
                LayerTrace(**{**layer, "gemms": tuple(TracedGemm(**g) for g in layer.get("gemms", ()))})
                for layer in data["layers"]
            )
            fields = {k: v for k, v in data.items() if k not in ("schema_version", "layers")}
            graph = cls(**fields, layers=layers)
        except (KeyError, TypeError) as err:
            raise NestError(f"layer graph: malformed ({err})") from None
        bad = sorted(k for k in {layer.kind for layer in layers} if k not in SLOT_KINDS and not is_kind_label(k))
        if bad:
            raise NestError(f"layer graph: unknown layer kind {bad[0]!r}; allowed are {', '.join(SLOT_KINDS)} and "
                            "layer kinds (dense, moe, mla+dense, mla+moe, mtp:moe, ...)")
        return graph

    @classmethod
    def from_json(cls, text: str) -> LayerGraph:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise NestError(f"layer graph: not JSON ({err})") from None
