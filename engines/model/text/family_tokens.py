"""Special tokens and chat templates as model families ship them, for tokenizers the project trains.

A user's model comes with its family's conventions: which token ends a turn (the EOS the engines stop on),
which pads, how a chat is rendered. The embedded model uses Kimi K2's; the transfer suite
(``benchmarks.transfer``) builds models with the others so that no default is tuned to one convention. The
templates are written here for plain user/assistant turns (no tools, no system-prompt defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.model.text.chat_format import K2_CHAT_TEMPLATE
from engines.model.text.tokenizer import EOS, PAD


@dataclass(frozen=True)
class TokenStyle:
    """A family's special tokens: ``eos`` ends a response (and a turn), ``pad`` pads (None: the family has no pad
    token and pads with EOS), ``extra`` are the other specials its template uses."""

    eos: str
    pad: str | None
    extra: tuple[str, ...]
    chat_template: str

    @property
    def specials(self) -> list[str]:
        return list(dict.fromkeys([*([self.pad] if self.pad else []), self.eos, *self.extra]))


# ChatML, as Qwen2/Qwen2.5/Qwen3 render it: <|im_start|>role\n...<|im_end|>\n
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Llama 3: a BOS, then headers around each role, each turn ended by <|eot_id|>
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Mistral/Mixtral instruct: <s>[INST] user [/INST] assistant</s>
MISTRAL_TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}</s>{% endif %}{% endfor %}")

def content_parts(image: str) -> str:
    """Jinja for one message's content: a string as is, or a list of parts (``{"type": "text", "text": ...}``, and
    ``image`` for each ``{"type": "image"}``), as vision-language models' templates render them."""
    return ("{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            f"{{% if c['type'] == 'image' %}}{image}{{% elif c['type'] == 'text' %}}{{{{ c['text'] }}}}{{% endif %}}"
            "{% endfor %}{% endif %}")


# Qwen2-VL / Qwen2.5-VL / Qwen3-VL: ChatML, each image as <|vision_start|><|image_pad|><|vision_end|>
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    + content_parts("<|vision_start|><|image_pad|><|vision_end|>") + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

STYLES: dict[str, TokenStyle] = {
    "k2": TokenStyle(EOS, PAD, (), K2_CHAT_TEMPLATE),
    "chatml": TokenStyle("<|im_end|>", "<|endoftext|>", ("<|im_start|>",), CHATML_TEMPLATE),
    "llama3": TokenStyle("<|eot_id|>", "<|finetune_right_pad_id|>",
                         ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"),
                         LLAMA3_TEMPLATE),
    "mistral": TokenStyle("</s>", None, ("<s>", "[INST]", "[/INST]"), MISTRAL_TEMPLATE),
    "qwen_vl": TokenStyle("<|im_end|>", "<|endoftext|>",
                          ("<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"),
                          QWEN_VL_TEMPLATE),
}
