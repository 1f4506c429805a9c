"""Byte-level BPE tokenizer built with ``tokenizers``; digits are always single tokens.

Splitting digits keeps arithmetic learnable for a tiny model. Saved as ``tokenizer.json`` plus
``tokenizer_config.json`` so ``transformers.AutoTokenizer`` loads it too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
PAD = "<|pad|>"


class TextTokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer`` with the ids the engines need."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.eos_id = tok.token_to_id(EOS)
        self.pad_id = tok.token_to_id(PAD)
        if self.eos_id is None or self.pad_id is None:
            raise ValueError(f"tokenizer must define {EOS} and {PAD}")

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([i for i in ids if i not in (self.eos_id, self.pad_id)])

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": EOS,
                    "pad_token": PAD,
                    "model_max_length": 1 << 30,
                    "clean_up_tokenization_spaces": False,
                },
                indent=2,
            )
        )
        (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS, "pad_token": PAD}))

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        return cls(Tokenizer.from_file(str(path)))


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 256) -> TextTokenizer:
    """Train a byte-level BPE tokenizer on ``corpus`` with digits kept as single tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return TextTokenizer(tok)
