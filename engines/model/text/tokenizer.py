"""Tokenizers: any Hugging Face tokenizer directory, and the project's own tiny BPE for the embedded default.

``TextTokenizer`` wraps ``transformers.AutoTokenizer`` so that a real model's ``tokenizer.json`` +
``tokenizer_config.json`` (special tokens, chat template) behave exactly as transformers makes them
behave. What the engines need on top: every id that ends a response (``eos_ids``: the tokenizer's
EOS plus the lists in ``generation_config.json`` and ``config.json``, e.g. Llama 3's ``<|eot_id|>``),
and a pad id that exists even when the tokenizer defines none (the first EOS: padded positions are
masked everywhere, so any real id serves).

The project's own tokenizer (``train_tokenizer``) is a byte-level BPE whose digits are always single
tokens, which keeps arithmetic learnable for a tiny model; its chat template is K2's format
(``chat_format.K2_CHAT_TEMPLATE``), so multi-turn tool episodes are rendered by a template for it too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from engines.model.text.family_tokens import TokenStyle
    from engines.model.text.processor import VisionProcessor

EOS = "<|endoftext|>"
PAD = "<|pad|>"


class ChatTemplateError(ValueError):
    """Chat-format input for a tokenizer that has no chat template."""


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class TextTokenizer:
    """A Hugging Face tokenizer with the ids the engines need (``eos_ids``, ``pad_id``)."""

    def __init__(self, hf, extra_eos_ids: Sequence[int] = (), pad_id: int | None = None,
                 source: str = "tokenizer") -> None:
        self.hf, self.source = hf, source
        self.tok: Tokenizer = hf.backend_tokenizer  # the Rust tokenizer (grammar-constrained decoding uses it)
        eos = _ids(hf.eos_token_id) + list(extra_eos_ids)
        self.eos_ids = list(dict.fromkeys(eos))  # ordered, no repeats
        if not self.eos_ids:
            raise ValueError(f"{source}: no EOS token (tokenizer_config.json eos_token or generation_config.json "
                             "eos_token_id), so responses could never end")
        self.eos_id = self.eos_ids[0]
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else pad_id
        if self.pad_id is None:
            self.pad_id = self.eos_id
        self._hidden = set(self.eos_ids) | {self.pad_id}
        #: render plain prompts as one user message through the chat template (``model.chat_template``)
        self.chat_prompts = False
        #: a vision-language model's own processor (``engines.model.text.processor``): renders prompts with images
        self.processor: VisionProcessor | None = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as is: no BOS/EOS added (templates and prompts carry their own)."""
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without EOS and padding (other special tokens, e.g. tool-call markers, stay)."""
        return self.hf.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` (OpenAI chat format) rendered with the model's chat template, as
        transformers renders them; ends with the assistant header when ``add_generation_prompt``."""
        if not self.has_chat_template:
            raise ChatTemplateError(f"{self.source} has no chat_template (tokenizer_config.json or "
                                    "chat_template.jinja), so chat-format `messages` cannot be rendered; "
                                    "use plain `prompt` tasks or a tokenizer with a template")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        return self.encode(text)

    def prompt_ids(self, task: Any) -> list[int]:
        """The prompt of a task as token ids: its ``messages`` through the chat template when it has
        them (or, with ``chat_prompts``, its prompt as one user message), else its ``prompt`` text. The one
        place every phase turns a task into tokens."""
        messages = getattr(task, "messages", None)
        if getattr(task, "images", ()):
            from engines.model.text.processor import VisionPromptError

            if self.processor is None:
                raise VisionPromptError(f"task {task.id} has images, but {self.source} is a text-only model's "
                                        "tokenizer (no image processor beside it)")
            ids = self.processor.render(messages)
            self.processor.check(ids, task.images, f"task {task.id}")
            return ids
        if not messages and self.chat_prompts:
            messages = [{"role": "user", "content": task.prompt}]
        return self.apply_chat_template(messages) if messages else self.encode(task.prompt)

    def prompt_length(self, task: Any) -> int:
        """The number of tokens the model reads for a task's prompt: ``prompt_ids``, with each image's
        placeholder counted as the tokens it expands into."""
        ids = self.prompt_ids(task)
        images = getattr(task, "images", ())
        return self.processor.expanded_length(ids, images, f"task {task.id}") if images else len(ids)

    def save(self, directory: str | Path) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (+ template), loadable by ``AutoTokenizer``."""
        self.hf.save_pretrained(str(directory))

    @classmethod
    def load(cls, directory: str | Path, chat_prompts: bool = False) -> TextTokenizer:
        """The tokenizer of a model directory; EOS ids also from its generation_config/config.json."""
        from transformers import AutoTokenizer

        d = Path(directory)
        if not (d / "tokenizer.json").is_file() and not (d / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{directory} has no tokenizer.json")
        try:
            hf = AutoTokenizer.from_pretrained(str(d))
        except Exception as e:  # transformers raises many types for a broken tokenizer directory
            raise ValueError(f"{directory}: transformers cannot load the tokenizer ({e})") from e
        gen, cfg = _json(d / "generation_config.json"), _json(d / "config.json")
        extra = _ids(gen.get("eos_token_id")) + _ids(cfg.get("eos_token_id"))
        pad = gen.get("pad_token_id", cfg.get("pad_token_id"))
        tok = cls(hf, extra, pad if isinstance(pad, int) else None, source=str(directory))
        tok.chat_prompts = chat_prompts
        from engines.model.text.processor import VisionProcessor, is_vision_dir

        if is_vision_dir(d):
            tok.processor = VisionProcessor.load(d)
        return tok


def wrap(tok: Tokenizer, eos: str = EOS, pad: str | None = PAD, chat_template: str | None = None) -> TextTokenizer:
    """A TextTokenizer over a ``tokenizers.Tokenizer`` built in memory (tests, the project's own)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, model_max_length=1 << 30,
                                 clean_up_tokenization_spaces=False)
    if chat_template is not None:
        hf.chat_template = chat_template
    return TextTokenizer(hf)


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 256, style: str | TokenStyle = "k2") -> TextTokenizer:
    """Train a byte-level BPE tokenizer on ``corpus`` with digits kept as single tokens, with the special tokens
    and chat template of ``style`` (a name of ``engines.model.text.family_tokens.STYLES``: k2, chatml, llama3, mistral;
    or a ``TokenStyle`` of one's own)."""
    from engines.model.text.family_tokens import STYLES, TokenStyle

    if isinstance(style, TokenStyle):
        st = style
    elif style not in STYLES:
        raise ValueError(f"tokenizer style {style!r}: one of {', '.join(STYLES)}")
    else:
        st = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=st.specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return wrap(tok, eos=st.eos, pad=st.pad, chat_template=st.chat_template)
