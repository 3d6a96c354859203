"""A small byte-level BPE tokenizer with Llama-3's special tokens, for tiny models.

It has the structure of Llama-3's tokenizer.json (regex split, byte-level BPE,
byte-level decoder) so the chat code exercises the same paths as the 8B one.
Special tokens: the five Llama-3 tokens and ``<pad>`` take ids 0..5, the image
placeholder ``<image>`` takes the last id (``vocab_size - 1``, the model
config's ``image_token_id``).
"""

from __future__ import annotations

from typing import Iterable

from fire_jax.data.chat import LLAMA3_SPECIAL_TOKENS, SYSTEM, TEACHER_INSTRUCTION
from fire_jax.data.records import IMAGE_PLACEHOLDER

#: Llama-3's pre-tokenizer split pattern.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PAD_TOKEN = "<pad>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """Train a byte-level BPE deterministically; ``<image>`` gets id ``vocab_size - 1``.

    The prompt strings (system prompt, teacher instruction, role names) are
    always part of the corpus.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, special_tokens=[*LLAMA3_SPECIAL_TOKENS, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [SYSTEM, TEACHER_INSTRUCTION, "system user assistant Question: Groundtruth: Score: Feedback:",
              *texts]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens([IMAGE_PLACEHOLDER])
    if tokenizer.get_vocab_size() != vocab_size or tokenizer.token_to_id(IMAGE_PLACEHOLDER) != vocab_size - 1:
        raise ValueError(f"corpus too small for a {vocab_size}-token vocabulary "
                         f"(got {tokenizer.get_vocab_size()} tokens)")
    return tokenizer
