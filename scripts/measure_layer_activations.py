#!/usr/bin/env python
"""Print the activation bytes one megatron-core TransformerLayer saves for backward.

Runs a few small shapes on CPU (a few seconds) through
``nest_megatron.trace.cpu_megatron.measure_layer_saved_bytes`` and prints, per
shape, the total and the breakdown by megatron submodule, each in bytes, in units
of s*b*h bytes and of a*s^2*b bytes, next to Korthikanti et al. (arXiv 2205.05198):
    GPT, dropout:   s*b*h*(34 + 5*a*s/h)     (bf16, 1-byte dropout masks)
The script doubles as a smoke test: it asserts invariants that must hold for any
correct measurement (see ``check``) and exits non-zero otherwise.

    .venv/bin/python scripts/measure_layer_activations.py [-v]

``-v`` also lists each saved storage (shape, dtype, the grad_fn that saved it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nest_megatron.trace.cpu_megatron import measure_layer_saved_bytes  # noqa: E402

GELU = dict(  # GPT-like: GELU MLP (ffn = 4h), MHA, dropout 0.1
    hidden_size=256,
    ffn_hidden_size=1024,
    num_attention_heads=8,
    num_query_groups=8,
    seq_length=128,
    micro_batch_size=2,
    swiglu=False,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
SWIGLU = dict(  # Llama-like: SwiGLU (ffn = 704 ~ 8h/3), GQA (2 groups), no dropout
    GELU, ffn_hidden_size=704, num_query_groups=2, swiglu=True, hidden_dropout=0.0,
    attention_dropout=0.0,
)
CASES = [
    ("gpt-gelu-drop0.1", GELU),
    ("gpt-gelu-drop0.1+selective", dict(GELU, recompute_granularity="selective")),
    ("llama-swiglu-gqa-nodrop", SWIGLU),
    ("llama-swiglu-gqa-nodrop+selective", dict(SWIGLU, recompute_granularity="selective")),
    ("gpt-gelu-drop0.1 LayerNorm", dict(GELU, normalization="LayerNorm")),
]


def korthikanti(c) -> float:
    s, b, h, a = c["seq_length"], c["micro_batch_size"], c["hidden_size"], c["num_attention_heads"]
    return s * b * h * (34 + 5 * a * s / h)


def check(name, c, r) -> None:
    """Invariants (a measurement that violates these is broken, not surprising)."""
    bd = r["breakdown"]
    assert r["total_bytes"] == sum(v["bytes"] for v in bd.values()), name
    assert 0 < r["total_referenced_bytes"] <= r["total_bytes"], name
    # fc2 always saves its input: [s, b, ffn] bf16.
    ffn_in = c["seq_length"] * c["micro_batch_size"] * c["ffn_hidden_size"] * 2
    assert bd["mlp.linear_fc2"]["bytes"] == ffn_in, name
    # Selective recompute: the core attention saves nothing of its own; the
    # checkpoint keeps only its inputs (q, k, v, mask, ...), attributed to
    # self_attention, and no saved tensor is score-shaped ([..., s, s] beyond the
    # [s, s] causal mask).  (Checked by shape, not size: with these shapes
    # a*s/h = 4, so a*s^2*b == 4*s*b*h == the GELU fc1 output size.)
    if c.get("recompute_granularity") == "selective":
        s = c["seq_length"]
        assert not any(k.startswith("self_attention.core_attention") for k in bd), name
        scores = [x for v in bd.values() for t in v["tensors"] for x in t["saves"]
                  if tuple(x["shape"][-2:]) == (s, s) and len(x["shape"]) > 2]
        assert not scores, (name, scores)


def fmt_row(label, nbytes, ref, r) -> str:
    return (
        f"  {label:<50s}{nbytes:>10d}{nbytes / r['sbh']:>9.3f}{nbytes / r['as2b']:>9.3f}"
        f"{ref / r['sbh']:>9.3f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-v", "--verbose", action="store_true", help="list saved tensors")
    args = ap.parse_args()

    for name, c in CASES:
        t0 = time.time()
        r = measure_layer_saved_bytes(**c)
        check(name, c, r)
        s, b, h, a = c["seq_length"], c["micro_batch_size"], c["hidden_size"], c["num_attention_heads"]
        print(
            f"\n== {name}: s={s} b={b} h={h} a={a} g={c['num_query_groups']} "
            f"ffn={c['ffn_hidden_size']} {'swiglu' if c['swiglu'] else 'gelu'} "
            f"drop={c['hidden_dropout']}/{c['attention_dropout']} "
            f"recompute={c.get('recompute_granularity')} norm={r['config']['normalization']} "
            f"({time.time() - t0:.1f}s)"
        )
        print(f"  {'submodule':<50s}{'bytes':>10s}{'/sbh':>9s}{'/as2b':>9s}{'ref/sbh':>9s}")
        for mod, v in r["breakdown"].items():
            print(fmt_row(mod, v["bytes"], v["referenced_bytes"], r))
            if args.verbose:
                for t in v["tensors"]:
                    saves = "; ".join(
                        f"{x['op']} {list(x['shape'])} {x['dtype']}" for x in t["saves"]
                    )
                    tag = " [LAYER INPUT]" if t["is_layer_input"] else ""
                    print(f"      {t['storage_bytes']:>9d} B (ref {t['referenced_bytes']}){tag}: {saves}")
        print(fmt_row("TOTAL", r["total_bytes"], r["total_referenced_bytes"], r))
        # Split the total into score-shaped storages ([b*a or b, a, s, s]: the
        # a*s^2*b term) and the rest (the s*b*h term), since with these shapes
        # a*s/h = 4 the two units alone cannot tell them apart.
        score = sum(
            t["storage_bytes"]
            for v in r["breakdown"].values()
            for t in v["tensors"]
            if any(len(x["shape"]) > 2 and tuple(x["shape"][-2:]) == (s, s) for x in t["saves"])
        )
        rest = r["total_bytes"] - score
        print(
            f"  = s*b*h*{rest / r['sbh']:.3f} + a*s^2*b*{score / r['as2b']:.3f}"
            f"   (Korthikanti: s*b*h*34 + a*s^2*b*5)"
        )
        k = korthikanti(c)
        print(
            f"  measured/(s*b*h) = {r['total_bytes'] / r['sbh']:.3f}   "
            f"Korthikanti 34+5as/h = {k / r['sbh']:.3f} ({k:.0f} B)   "
            f"layer input saved: {r['input_saved']} {r['input_saved_by']}   "
            f"params referenced (excluded): {r['param_bytes_saved']} B"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
