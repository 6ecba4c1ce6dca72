"""A tiny byte-level BPE tokenizer built in memory (with ChatML special tokens), so tests need no download.

Its small vocabulary splits multi-byte characters (accents, CJK, emoji) across several tokens,
which is what the incremental detokenizer has to cope with.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|pad|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "héllo wörld, this is a tiny corpus for a tiny tokenizer.",
    "你好，世界! 你好 🙂 hello again",
    "The quick brown fox jumps over the lazy dog. STOP here.",
    "naïve café résumé — 東京 🚀🙂",
    "def main():\n    return 42\n",
]


@lru_cache(maxsize=1)
def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with a 300-token vocabulary; ``eos_token`` is ``<|endoftext|>``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token="<|pad|>")
