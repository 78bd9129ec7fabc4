"""The layer split as Megatron-LM computes it from its flags, written once.

Megatron builds pp*vpp model chunks; chunk c = k*pp + r is the k-th virtual stage of pipeline rank r
(megatron/core/transformer/pipeline_parallel_layer_layout.py:49-55, transformer_block.py:161-186). A split
here is the tuple of decoder layers each chunk builds, in that order: what the cost model prices
(cost/tables.py chunk_bounds, chunk_sums), what plan.layers_per_stage holds with pp*vpp entries and what a Plan carries.
Megatron-LM (d98e8a6) is told a split in one of four ways (`SplitForm`); with N layers, p = pp, v = vpp
(1 without virtual stages):

- **even** (no flag): every chunk N / (p v). arguments.py:985-998 asks p | N (with no virtual-stage flag);
  get_num_layers_to_build (transformer_block.py:156-186) asserts it and v | N / p.
- **--account-for-embedding-in-pipeline-split** (e = 1) and/or **--account-for-loss-in-pipeline-split**
  (l = 1): the embedding and the loss each count as one layer, M = N + e + l; every chunk M / (p v), less e
  on chunk 0 (rank 0's first) and l on chunk p v - 1 (the last rank's last): transformer_block.py:148-202,
  transformer_layer.py:184-216 (the offsets agree). transformer_config.py:2370-2412 asks p | M and, with
  virtual stages, v | M / p; transformer_block.py:194-201 that those chunks keep >= 0 layers.
- **--decoder-first-pipeline-num-layers F** and/or **--decoder-last-pipeline-num-layers L**: rank 0 holds F,
  rank p - 1 holds L, the other ("middle") ranks share the rest evenly; each rank splits its layers evenly
  over its v chunks: transformer_block.py:103-186, transformer_layer.py:79-167. transformer_config.py:
  2295-2368 asks F, L > 0, v | F, v | L, middle layers exactly when there are middle ranks, the middle ranks
  dividing them, v dividing each middle rank's; with v > 1 and both given, get_transformer_layer_offset
  (transformer_layer.py:158-165) divides by the middle ranks, so it needs one.
- **--pipeline-model-parallel-layout S**: S's stages, split by '|', are the chunks in order; 't' a decoder
  layer, 'E' the embedding, 'L' the loss, 'm' an MTP layer; 'X*n' and '(...)*n' repeat, commas are
  cosmetic (pipeline_parallel_layer_layout.py:283-325). Its stages set v = stages / p (arguments.py:941-952);
  validate_layer_layout (:86-151) asks E first, L last, once each, N t's, the MTP layers after every t, in
  a rank's last virtual stage and all in one stage.

The forms exclude each other (`EXCLUSIONS`); the virtual-stage count comes from
--num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage, or from the layout.
`chunk_layers` turns a valid form into its chunks, `form_problem` says why a form does not build,
`simplest_form` finds the fewest flags that give a split, and `searched_splits` is the planner's family of
uneven splits with virtual stages (solver/README.md).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, fields
from functools import lru_cache

LAYOUT_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
MTP = "m"
PLAN = "plan."  # the plan.* key of a SplitForm field is plan.<field>; its Megatron flag --<field with dashes>


@dataclass(frozen=True)
class SplitForm:
    """How Megatron is told the layer split: its flags, snake_cased (also the plan.* keys). All unset: even."""

    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_model_parallel_layout: str | None = None

    @classmethod
    def from_fields(cls, source) -> SplitForm:
        """The form of an object with fields of these names (a PlanChoice, whose unset account flags are None);
        EVEN itself when it sets none."""
        form = cls(**{name: bool(getattr(source, name)) if name in ACCOUNT_FIELDS else getattr(source, name)
                      for name in FORM_FIELDS})
        return EVEN if form == EVEN else form

    @property
    def given(self) -> tuple[str, ...]:
        """The fields set, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) not in (False, None))

    @property
    def accounts(self) -> tuple[int, int]:
        """(e, l): 1 for the embedding / the loss counted as a layer."""
        return int(self.account_for_embedding_in_pipeline_split), int(self.account_for_loss_in_pipeline_split)

    @property
    def first_last(self) -> tuple[int | None, int | None]:
        return self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers


EVEN = SplitForm()
ACCOUNT_FORMS = (SplitForm(account_for_embedding_in_pipeline_split=True), SplitForm(account_for_loss_in_pipeline_split=True),
                 SplitForm(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True))
FORM_FIELDS = tuple(f.name for f in fields(SplitForm))
ACCOUNT_FIELDS = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
FIRST_LAST_FIELDS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
LAYOUT_FIELD = "pipeline_model_parallel_layout"
# The forms Megatron refuses together: (rule id, one side, the other side, source at d98e8a6).
TC = "megatron/core/transformer/transformer_config.py"
EXCLUSIONS = (
    ("layout-first-last", (LAYOUT_FIELD,), FIRST_LAST_FIELDS, f"{TC}:2242-2259"),
    ("layout-account", (LAYOUT_FIELD,), ACCOUNT_FIELDS, f"{TC}:2242-2259"),
    ("first-last-account", FIRST_LAST_FIELDS, ACCOUNT_FIELDS,
     f"{TC}:2229-2240; megatron/core/transformer/transformer_block.py:108-112"),
)


def flag_of(name: str) -> str:
    """The Megatron flag of a SplitForm field."""
    return "--" + name.replace("_", "-")


def excluded_pair(form: SplitForm, one: tuple[str, ...], other: tuple[str, ...]) -> tuple[str, str] | None:
    """The first field of `one` and of `other` that `form` sets both of, or None."""
    given = form.given
    a = next((name for name in one if name in given), None)
    b = next((name for name in other if name in given), None)
    return (a, b) if a and b else None


def layout_stages(layout: str) -> list[str]:
    """The layout's stages with every repetition unrolled, as PipelineParallelLayerLayout.parse_str_to_list
    reads it (the same two substitutions, in the same order: a nested parenthesis is left as Megatron leaves it)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def layout_problem(layout: str, *, pp: int, num_layers: int, mtp_num_layers: int | None = None) -> str | None:
    """Why Megatron refuses the layout at `pp` stages (pipeline_parallel_layer_layout.py: parse_str_to_list,
    __init__, validate_layer_layout), one line naming plan.pipeline_model_parallel_layout; None when it builds.
    `mtp_num_layers`: the model's MTP layers (None: it has none)."""
    key = f"{PLAN}{LAYOUT_FIELD}={layout}"
    stages = layout_stages(layout)
    flat = "".join(stages)
    unknown = sorted(set(flat) - set(LAYOUT_CHARS))
    if unknown:
        return (f"{key}: {unknown} are no layers; a stage holds {', '.join(f'{c} ({w})' for c, w in LAYOUT_CHARS.items())}, "
                "stages are split by '|', 'X*n' and '(...)*n' repeat (not nested), commas are cosmetic")
    if len(stages) % pp:
        return f"{key}: {len(stages)} stages is not a multiple of plan.pp={pp}"
    if flat[:1] != "E" or flat[-1:] != "L" or flat.count("E") != 1 or flat.count("L") != 1:
        return f"{key}: the embedding E must come first and the loss L last, once each"
    if flat.count("t") != num_layers:
        return f"{key}: {flat.count('t')} transformer layers (t), but num_layers={num_layers}"
    return _mtp_problem(key, stages, pp=pp, mtp_num_layers=mtp_num_layers)


def _mtp_problem(key: str, stages: list[str], *, pp: int, mtp_num_layers: int | None) -> str | None:
    """validate_layer_layout's MTP checks (pipeline_parallel_layer_layout.py:111-140)."""
    flat = "".join(stages)
    count = flat.count(MTP)
    if count != (mtp_num_layers or 0):
        if not mtp_num_layers:
            return f"{key}: {count} MTP layers (m), but the model has no multi-token prediction layers"
        return f"{key}: {count} MTP layers (m), but the model has mtp_num_layers={mtp_num_layers}"
    if not count:
        return None
    if "t" in flat[flat.index(MTP):]:
        return f"{key}: the MTP layers (m) must come after every transformer layer (t)"
    vpp = len(stages) // pp
    holding = [i for i, stage in enumerate(stages) if MTP in stage]
    if any(i // pp != vpp - 1 for i in holding):  # stage i is rank i % pp's virtual stage i // pp
        return f"{key}: the MTP layers (m) must be in the last virtual stage of their pipeline rank"
    if len(holding) > 1:
        return f"{key}: the MTP layers (m) must all be in one stage"
    return None


def account_problem(form: SplitForm, *, num_layers: int, pp: int, vpp: int) -> str | None:
    """Why Megatron refuses the embedding and / or loss counted as layers at pp x vpp, or None."""
    e, l = form.accounts
    if not (e or l):
        return None
    counted = num_layers + e + l
    names = " and ".join(f"{PLAN}{name}=true" for name, on in zip(ACCOUNT_FIELDS, (e, l)) if on)
    if counted % pp:
        return f"{names}: num_layers + {e + l} = {counted} must be a multiple of plan.pp={pp}"
    if (counted // pp) % vpp:
        return (f"{names}: the {counted // pp} layers of each pipeline rank (num_layers + {e + l} over plan.pp={pp}) "
                f"must be a multiple of plan.vpp={vpp}")
    if counted // (pp * vpp) < max(e, l) or (pp * vpp == 1 and counted < e + l):
        return f"{names}: a model chunk of {counted // (pp * vpp)} layers cannot also hold the embedding or the loss"
    return None


def first_last_problem(form: SplitForm, *, num_layers: int, pp: int, vpp: int) -> str | None:
    """Why Megatron refuses the first / last stage layer counts at pp x vpp, or None."""
    first, last = form.first_last
    if first is None and last is None:
        return None
    for name, value in zip(FIRST_LAST_FIELDS, (first, last)):
        if value is not None and value <= 0:
            return f"{PLAN}{name}={value}: must be at least 1"
        if value is not None and value % vpp:
            return f"{PLAN}{name}={value}: must be a multiple of plan.vpp={vpp} (each virtual stage holds the same)"
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    given = ", ".join(f"{PLAN}{n}={v}" for n, v in zip(FIRST_LAST_FIELDS, (first, last)) if v is not None)
    if rest < 0 or bool(rest) != bool(middle):
        return f"{given}: leave {rest} layers for {middle} middle pipeline stages (need some layers exactly when there are some stages)"
    if vpp > 1 and middle == 0:  # transformer_layer.py:158-165 divides a later rank's offset by the middle stages
        return f"{given} with plan.vpp={vpp}: megatron-core needs a middle pipeline stage (pp > 2) to place the chunks"
    if middle and rest % (middle * vpp):
        return (f"{given}: the other {rest} layers must split evenly over {middle} middle pipeline stages x "
                f"plan.vpp={vpp} virtual stages")
    return None


def even_problem(*, num_layers: int, pp: int, vpp: int) -> str | None:
    """Why Megatron refuses its even split at pp x vpp, or None."""
    if num_layers % (pp * vpp):
        return f"plan.pp={pp} x plan.vpp={vpp}: must divide num_layers={num_layers} for an even split"
    return None


def split_hint(*, num_layers: int, pp: int, vpp: int, mtp_num_layers: int = 0, hybrid: bool = False) -> str:
    """What to give where the even split does not build: the plan.* keys of the simplest searched split there; for a
    hybrid stack, whose launch line says a split only by '|' segments, the nearest to even as plan.layers_per_stage."""
    if hybrid:
        count = pp * vpp
        chunks = [num_layers // count + (k < num_layers % count) for k in range(count)]
        return (f"give the split, e.g. plan.layers_per_stage=[{','.join(map(str, chunks))}] (on a launch line, "
                "'|' segments of --hybrid-layer-pattern with those layers)")
    family = searched_splits(num_layers, pp, vpp) if vpp > 1 and pp > 1 else ()
    if not family:
        return "give the split (plan.layers_per_stage or plan.pipeline_model_parallel_layout)"
    form = simplest_form(family[0], num_layers=num_layers, pp=pp, mtp_num_layers=mtp_num_layers)
    if form.pipeline_model_parallel_layout is not None:
        return f"give the split, e.g. {PLAN}{LAYOUT_FIELD}='{form.pipeline_model_parallel_layout}'"
    keys = " ".join(f"{PLAN}{name}={str(getattr(form, name)).lower()}" for name in form.given)
    if any(form.accounts):
        counted = num_layers + sum(form.accounts)
        keys += f" ({num_layers} + {sum(form.accounts)} = {counted} = {pp} x {vpp} x {counted // (pp * vpp)})"
    return f"give the split, e.g. {keys}"


def form_vpp(form: SplitForm, *, pp: int) -> int | None:
    """The virtual stages a layout sets (its stages / pp); None for the other forms (the plan's vpp)."""
    layout = form.pipeline_model_parallel_layout
    if layout is None:
        return None
    stages = len(layout_stages(layout))
    return stages // pp if stages % pp == 0 else None


def chunk_layers(form: SplitForm, *, num_layers: int, pp: int, vpp: int) -> tuple[int, ...]:
    """The decoder layers of each of the pp*vpp model chunks Megatron builds for `form` (chunk k*pp + r: rank
    r's k-th), as get_num_layers_to_build computes them. `form` must build at pp x vpp (its *_problem None)."""
    p, v, n = pp, vpp, num_layers
    layout = form.pipeline_model_parallel_layout
    if layout is not None:
        return tuple(stage.count("t") for stage in layout_stages(layout))
    first, last = form.first_last
    if first is not None or last is not None:
        middle = p - (first is not None) - (last is not None)
        rest = n - (first or 0) - (last or 0)
        per_rank = [rest // middle if middle else 0] * p
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return tuple(per_rank[c % p] // v for c in range(p * v))
    e, l = form.accounts
    per_chunk = (n + e + l) // (p * v)
    chunks = [per_chunk] * (p * v)
    chunks[0] -= e
    chunks[-1] -= l
    return tuple(chunks)


def as_chunks(split: tuple[int, ...], *, pp: int, vpp: int) -> tuple[int, ...]:
    """A split of pp*vpp entries (per model chunk) as it is; of pp entries (per pipeline rank) each rank's layers
    split evenly over its vpp chunks, the earlier chunks taking one more where vpp does not divide them
    (parallel.rules asks that it does, as Megatron asks of first / last stage counts)."""
    if len(split) == pp * vpp:
        return tuple(split)
    if len(split) != pp:
        raise ValueError(f"layers_per_stage={list(split)}: pp={pp} or pp*vpp={pp * vpp} entries")
    per_rank = [[n // vpp + (k < n % vpp) for k in range(vpp)] for n in split]
    return tuple(per_rank[c % pp][c // pp] for c in range(pp * vpp))


# A hybrid (Mamba) stack's split: its pattern cut by '|' into pp*vpp segments, segment k*pp + r the k-th virtual
# stage of rank r (megatron/core/models/hybrid/hybrid_layer_allocation.py:331-490 select_pipeline_segment at
# d98e8a6; an empty segment is an empty stage). Megatron-LM derives the virtual stages from the segments and takes
# no other split or virtual-stage flag beside them (training/arguments.py:800-858).
PIPE = "|"


def piped_pattern(pattern: str, chunks: tuple[int, ...]) -> str:
    """`pattern` (one symbol a layer) cut into the chunks' segments."""
    if sum(chunks) != len(pattern):
        raise ValueError(f"chunks {list(chunks)} do not add up to the pattern's {len(pattern)} layers")
    bounds = [0, *itertools.accumulate(chunks)]
    return PIPE.join(pattern[a:b] for a, b in zip(bounds, bounds[1:]))


def pattern_chunks(text: str) -> tuple[int, ...]:
    """The layers of each '|' segment of a hybrid pattern (one entry for a pattern without pipes), before any '/'
    multi-token-prediction depth (which sits on the last stage: arguments.py:802 at d98e8a6 looks for pipes there)."""
    return tuple(len(segment) for segment in text.split("/")[0].split(PIPE))


def rank_layers(chunks: tuple[int, ...], *, pp: int) -> list[int]:
    """The layers each pipeline rank holds over its chunks."""
    return [sum(chunks[r::pp]) for r in range(pp)]


def layout_string(chunks: tuple[int, ...], *, mtp_num_layers: int = 0) -> str:
    """The chunks as a --pipeline-model-parallel-layout: 'E' on the first stage, 'L' on the last, a run of equal
    stages between them as '(<stage>|)*n,' (Megatron unrolls it back: `layout_stages`), e.g. 'Et|(t*2|)*62,tL';
    the MTP layers ('m') on the last stage before the loss, where Megatron requires as many as --mtp-num-layers."""
    stages = ["" if n == 0 else "t" if n == 1 else f"t*{n}" for n in chunks]
    stages[-1] += "m" * mtp_num_layers
    if len(stages) == 1:
        return f"E{stages[0]}L"
    text, middle, i = f"E{stages[0]}|", stages[1:-1], 0
    while i < len(middle):
        run = next((j for j in range(i, len(middle)) if middle[j] != middle[i]), len(middle)) - i
        text += f"({middle[i]}|)*{run}," if run > 1 else f"{middle[i]}|"
        i += run
    return f"{text}{stages[-1]}L"


def simplest_form(chunks: tuple[int, ...], *, num_layers: int, pp: int, mtp_num_layers: int = 0) -> SplitForm:
    """The fewest Megatron flags that build `chunks` (pp*vpp entries): none for the even split, then the
    embedding / loss counted as layers, then first / last stage counts, else a layout. Each candidate is checked
    by building it with `chunk_layers`, the one function that reads every form."""
    vpp = len(chunks) // pp
    ranks = rank_layers(chunks, pp=pp)
    first_last = []
    if pp >= 3:
        middle = ranks[1]
        first_last.append(SplitForm(decoder_first_pipeline_num_layers=ranks[0] if ranks[0] != middle else None,
                                    decoder_last_pipeline_num_layers=ranks[-1] if ranks[-1] != middle else None))
    elif pp == 2:
        first_last.append(SplitForm(decoder_first_pipeline_num_layers=ranks[0]))
    candidates = [EVEN, *ACCOUNT_FORMS, *first_last]
    for form in candidates:
        if (form_problem(form, num_layers=num_layers, pp=pp, vpp=vpp) is None
                and chunk_layers(form, num_layers=num_layers, pp=pp, vpp=vpp) == tuple(chunks)):
            return form
    return SplitForm(pipeline_model_parallel_layout=layout_string(tuple(chunks), mtp_num_layers=mtp_num_layers))


def form_problem(form: SplitForm, *, num_layers: int, pp: int, vpp: int, mtp_num_layers: int | None = None) -> str | None:
    """Why Megatron does not build `form` at pp x vpp, one line; None when it does (the forms' exclusions aside:
    EXCLUSIONS)."""
    layout = form.pipeline_model_parallel_layout
    if layout is not None:
        found = layout_problem(layout, pp=pp, num_layers=num_layers, mtp_num_layers=mtp_num_layers)
        if found is None and form_vpp(form, pp=pp) != vpp:
            found = (f"{PLAN}{LAYOUT_FIELD}={layout}: {len(layout_stages(layout))} stages are "
                     f"{form_vpp(form, pp=pp)} virtual stages of plan.pp={pp}, but plan.vpp={vpp}")
        return found
    if form.first_last != (None, None):
        return first_last_problem(form, num_layers=num_layers, pp=pp, vpp=vpp)
    if any(form.accounts):
        return account_problem(form, num_layers=num_layers, pp=pp, vpp=vpp)
    return even_problem(num_layers=num_layers, pp=pp, vpp=vpp)


# A stage of one layer spends as much on its pipeline transfers as on a layer's work; a planner that
# picks it (the first and last stages lighten so, beside the embedding and the loss) is trading a
# model artefact for a plan nobody would run. Pinned sizes may still ask for it.
MIN_STAGE_LAYERS = 2


def min_stage_layers(num_layers: int, pp: int) -> int:
    """The fewest layers a searched split gives a pipeline rank: MIN_STAGE_LAYERS when the layers allow it."""
    return MIN_STAGE_LAYERS if num_layers >= MIN_STAGE_LAYERS * pp else 1


@lru_cache(maxsize=4096)
def searched_splits(num_layers: int, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """The uneven splits with virtual stages (vpp > 1) the planner searches, as chunk tuples, simplest form first
    (even, the embedding / loss counted, first / last counts, layouts; then by their numbers): every split that

    - keeps every middle chunk at c layers and the first and last chunks at 0..c each ("ends"), or
    - gives every chunk of a rank the same layers, the middle ranks m each and the first and last ranks 1..m
      (any with two ranks) ("first/last"),

    and leaves each rank at least `min_stage_layers`. Both families hold the even split and the embedding /
    loss counted; the ends lighter than the middle is what the embedding, the loss and the first rank's
    activations in flight ask for. solver/README.md gives the reasoning."""
    n, p, v = num_layers, pp, vpp
    count = p * v
    shortest = min_stage_layers(n, p)
    found: dict[tuple[int, ...], None] = {}
    for c in range(max(1, -(-n // count)), n // (count - 2) + 1):  # "ends": a + b + (count - 2) c = n, a, b <= c
        ends = n - (count - 2) * c
        for a in range(max(0, ends - c), min(c, ends) + 1):
            found[(a, *[c] * (count - 2), ends - a)] = None
    if n % v == 0:  # "first/last": rank r's v chunks hold s_r each
        row = n // v  # one chunk of every rank
        if p == 2:
            ranks = [(s, row - s) for s in range(1, row)]
        else:
            ranks = [(s, *[m] * (p - 2), row - (p - 2) * m - s) for m in range(1, row // (p - 2) + 1)
                     for s in range(max(1, row - (p - 1) * m), min(m, row - (p - 2) * m - 1) + 1)]
        for per_chunk in ranks:
            found[tuple(per_chunk[c % p] for c in range(count))] = None
    kept = [chunks for chunks in found if min(rank_layers(chunks, pp=p)) >= shortest]
    accounted = {chunk_layers(form, num_layers=n, pp=p, vpp=v) for form in ACCOUNT_FORMS
                 if account_problem(form, num_layers=n, pp=p, vpp=v) is None}

    def simplicity(chunks: tuple[int, ...]) -> int:
        """simplest_form's order, cheaply: 0 even, 1 the embedding / loss counted, 2 each rank's chunks equal (first
        / last counts give it), 3 a layout."""
        if len(set(chunks)) == 1:
            return 0
        if chunks in accounted:
            return 1
        return 2 if all(len(set(chunks[r::p])) == 1 for r in range(p)) else 3

    return tuple(sorted(kept, key=lambda chunks: (simplicity(chunks), chunks)))
