"""nn.Module factories for tests/test_trace.py (model.source=module): a small GPT written in plain
torch, so that its parameters and FLOPs can be worked out by hand."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H, HEADS, FFN, VOCAB, SEQ, LAYERS = 64, 4, 256, 512, 32, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(context.transpose(1, 2).reshape(b, s, H))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTorchGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_torch_gpt():
    """The module alone: the tracer feeds one sequence of model.seq_length token ids."""
    return TinyTorchGPT()


def tiny_torch_gpt_batch2():
    """The module and its example input: two sequences of SEQ tokens."""
    return TinyTorchGPT(), torch.zeros(2, SEQ, dtype=torch.long)


def not_a_module():
    return 42


def no_blocks():
    return nn.Linear(4, 4)
