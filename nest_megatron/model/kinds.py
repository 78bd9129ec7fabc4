"""What one layer of a model is: its mixer and its MLP, and whether it is a multi-token-prediction depth.

A transformer layer is two blocks, each with its own pre-norm and residual add: a mixer (standard
self-attention, multi-head latent attention, ...) and an MLP (dense, mixture of experts, ...). The cost
model prices a layer block by block (`model/spec.py`: parameters, GEMMs, attention FLOPs;
`cost/activations.py`: saved bytes; `cost/layer.py`: memory-bound bytes and TP communication), so a new
kind of block -- a Mamba-2 mixer, say -- is one more value of `mixer` and one more case in each of
those, and a layer with one block only (Megatron's hybrid stacks: '*' attention alone, '-' an MLP
alone, 'E' experts alone) is a kind whose other block is "none".

`ModelSpec.layer_kinds` lists the kind of every decoder layer (Megatron's --moe-layer-freq, int or
list); the multi-token-prediction depths, which sit after the decoder on the last pipeline stage, are
`ModelSpec.mtp_depth_kinds` (a depth's layers, the first with `mtp` set: the depth's own norms and projection).
"""

from __future__ import annotations

from typing import NamedTuple

from nest_megatron.errors import NestError

# The mixers: attention (megatron-core SelfAttention), mla (MLASelfAttention: --multi-latent-attention),
# mamba (a Mamba-2 MambaMixer: a hybrid pattern's 'M'), none (a layer without one). The MLPs: dense (MLP),
# moe (MoELayer), none.
MIXERS = ("attention", "mla", "mamba", "none")
MLPS = ("dense", "moe", "none")


class _Kind(NamedTuple):
    mixer: str = "attention"
    mlp: str = "dense"
    # A multi-token-prediction depth (megatron-core MultiTokenPredictionLayer): the layer, plus the norms of
    # the hidden state and of the shifted tokens' embedding, the 2h -> h projection and its final norm.
    mtp: bool = False


class LayerKind(_Kind):
    """A layer's kind: immutable, and hashed and compared as a tuple (the cost caches key on it, the search
    millions of times)."""

    __slots__ = ()

    def __new__(cls, mixer: str = "attention", mlp: str = "dense", mtp: bool = False):
        if mixer not in MIXERS or mlp not in MLPS:
            raise NestError(f"layer kind {mixer}/{mlp}: mixers are {', '.join(MIXERS)}; MLPs are {', '.join(MLPS)}")
        return super().__new__(cls, mixer, mlp, mtp)

    @property
    def is_moe(self) -> bool:
        return self.mlp == "moe"

    @property
    def label(self) -> str:
        """The name of the kind in a layer graph (model/layer_graph.py): 'dense' and 'moe' for a standard
        attention layer (the names traced graphs have had since schema 1), 'mixer+mlp' otherwise, with an
        'mtp:' prefix for a multi-token-prediction depth."""
        base = self.mlp if self.mixer == "attention" else f"{self.mixer}+{self.mlp}"
        return f"mtp:{base}" if self.mtp else base

    @classmethod
    def from_label(cls, label: str) -> LayerKind:
        mtp = label.startswith("mtp:")
        base = label.removeprefix("mtp:")
        mixer, _, mlp = base.rpartition("+")
        return cls(mixer=mixer or "attention", mlp=mlp, mtp=mtp)


# A hybrid pattern's symbols (megatron-core 0.16.1 ssm/mamba_hybrid_layer_allocation.py:25-32) and the layer each
# builds (ssm/mamba_block.py MambaStack): a Mamba layer, a transformer layer with attention only, one with an MLP
# only, one with a MoE MLP only.
HYBRID_KINDS = {"M": LayerKind("mamba", "none"), "*": LayerKind("attention", "none"),
                "-": LayerKind("none", "dense"), "E": LayerKind("none", "moe")}


def is_kind_label(label: str) -> bool:
    try:
        LayerKind.from_label(label)
    except NestError:
        return False
    return True
