"""The vocabulary a launch runs: the embedding rows the plan priced, and a tokenizer that fits them.

The plan prices model.vocab_size tokenizer entries in model.padded_vocab(tp) embedding rows. Megatron builds the
rows --padded-vocab-size gives whatever the tokenizer (megatron/training/argument_utils.py:474-476), but the
tokenizer comes from the user's flags, and only some of them tell its size (config/megatron_argv.py
tokenizer_vocab). So a tokenizer the flags say is of another size is refused, one that reads --vocab-size is given
it, and one whose size nothing tells is run with the planned rows and said so in the changes list.
"""

from __future__ import annotations

from nest_megatron.config.megatron_argv import Scanned, tokenizer_vocab
from nest_megatron.config.schema import ModelConfig
from nest_megatron.errors import NestError

# Tokenizers that take their size from --vocab-size (megatron/core/tokenizers/utils/build_tokenizer.py:58-65, 96-102); no --tokenizer-type
# is this project's scripts/pretrain_gpt.py, which reads --vocab-size as they do.
READS_VOCAB_SIZE = frozenset({None, "TikTokenizer", "NullTokenizer", "NullMultimodalTokenizer"})


def vocabulary_flags(s: Scanned, model: ModelConfig, rows: int, *, model_from_argv: bool) -> tuple[list[str], list[str]]:
    """(flags to add to the user's argv, change lines) so that the launch runs the vocabulary the plan priced:
    `rows` embedding rows for model.vocab_size entries. One line (NestError) when the user's tokenizer flags give
    another size than the plan's."""
    told = tokenizer_vocab(s)
    tokenizer = s.get("--tokenizer-type")
    if told is not None and told != model.vocab_size:
        given = f"--tokenizer-type {tokenizer}" if tokenizer else "--vocab-size"
        raise NestError(f"the script's tokenizer ({given}) has {told:,} entries but the plan prices "
                        f"model.vocab_size={model.vocab_size:,}: give model.vocab_size={told}, or a tokenizer of "
                        f"{model.vocab_size:,} entries")
    if told is not None or s.has("--padded-vocab-size"):
        return [], []  # Megatron pads the told size to the planned rows, or the user's argv fixed them
    if tokenizer in READS_VOCAB_SIZE:  # given its size, Megatron pads it to the planned rows
        return ["--vocab-size", str(model.vocab_size)], []
    added = ["--padded-vocab-size", str(rows)] if model_from_argv else []  # from model=NAME the plan's argv has it
    source = f"--tokenizer-model {s.get('--tokenizer-model')}" if s.has("--tokenizer-model") else f"--tokenizer-type {tokenizer}"
    return added, [f"--padded-vocab-size: {rows} rows for the {model.vocab_size:,} entries the plan assumes "
                   f"(model.vocab_size); {source} does not tell its size here: a tokenizer with more ids than "
                   f"{rows} fails at the first step"]
