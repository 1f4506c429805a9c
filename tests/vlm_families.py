"""Tiny random vision-language models of several families, saved as Hugging Face directories that both transformers
(``AutoModelForImageTextToText`` + ``AutoProcessor``) and vLLM load, for the vision survey (``tests/vlm_survey.py``).

``save_tiny_vlm(family, directory)`` writes ``config.json`` + weights (sharpened like ``tests.hf_families.sharpen``
so that log-probs are far from uniform), and the processor: image processor, tokenizer (the project's byte-level BPE
trained on arithmetic tasks, with the family's special tokens) and a chat template written here in the family's
own style for ``{"type": "image"}`` parts, with a generation prompt.

Every language model has head_dim 32 (vLLM's CPU attention has no kernel for smaller heads): hidden 64, 2 query
heads of 32, one key/value head, 2 layers. Vision towers have 2 layers, hidden 32, one head, and image sizes that
make an image a handful of tokens (``VlmFamily.image_tokens`` at ``IMAGE_SIZES``).

What it takes for both libraries to load a directory (each fix-up is on the family that needs it):

* CLIP/SigLIP towers (LLaVA, LLaVA-NeXT, Gemma 3, PaliGemma, LFM2-VL): transformers 5 saves a tower built from a
  config flat (``vision_tower.embeddings...``); vLLM 0.32 loads only the published ``vision_tower.vision_model.``
  layout, which transformers loads too. No config choice avoids it: the weights are renamed after saving
  (``published=("tower",)``). A model loaded from a published checkpoint is re-saved in the published layout.
* Qwen3-VL-MoE: ``save_pretrained`` writes the fused experts in transformers' in-memory [experts, out, in] layout,
  also for a model loaded from a published checkpoint (the reverse of its load-time transpose compares a parameter's
  shape with itself); vLLM loads only the published [experts, in, out] (``published=("experts",)``).
* Gemma 3 and PaliGemma: vLLM's processors look up ``"\n"`` (and ``"\n\n"`` ... ``"\n\n\n\n"`` for Gemma 3) in the
  vocabulary, as SentencePiece vocabularies have them; a byte-level BPE needs them added (``added``).
* Processors read named tokens from the tokenizer (Gemma 3's ``boi_token``, InternVL's ``context_image_token``,
  ...): saved in tokenizer_config.json (``named``). PaliGemma's processor adds 1152 ``<loc>``/``<seg>`` tokens, so
  its model's vocabulary is sized after the processor is made.
* SmolVLM's processor needs the ``num2words`` package.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.model.text.family_tokens import STYLES, TokenStyle, content_parts

#: The language model shared by every family (its own config class adds the rest).
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, max_position_embeddings=512)
#: (width, height) of the test images: a landscape and a portrait one, so grids are not square.
IMAGE_SIZES = ((84, 56), (56, 84))


_content = content_parts  # the project's content-parts Jinja (engines.model.text.family_tokens)
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL: ChatML, each image as <|vision_start|><|image_pad|><|vision_end|>
QWEN_VL_STYLE = STYLES["qwen_vl"]


# Idefics3 / SmolVLM: "User:<image>text<end_of_utterance>\nAssistant:" (the processor expands <image> into
# <fake_token_around_image>, <row_i_col_j> / <global-img> and image_seq_len <image> tokens)
IDEFICS_SPECIALS = ("<fake_token_around_image>", "<image>", "<global-img>",
                    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))
_IDEFICS_TURNS = ("{% for m in messages %}{{ m['role'] | capitalize }}"
                  "{% if m['content'] is not string and m['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
                  + _content("<image>") + "<end_of_utterance>\n{% endfor %}"
                  "{% if add_generation_prompt %}Assistant:{% endif %}")
IDEFICS3_STYLE = TokenStyle("<end_of_utterance>", "<|endoftext|>", ("<|begin_of_text|>", *IDEFICS_SPECIALS),
                            "<|begin_of_text|>" + _IDEFICS_TURNS)
SMOLVLM_STYLE = TokenStyle("<end_of_utterance>", "<|endoftext|>", ("<|im_start|>", *IDEFICS_SPECIALS),
                           "<|im_start|>" + _IDEFICS_TURNS)

# Gemma 3: <bos><start_of_turn>user\n...<end_of_turn>\n, the assistant role named "model"; each image as
# <start_of_image> (the processor expands it to \n\n<start_of_image><image_soft_token>*N<end_of_image>\n\n)
GEMMA3_STYLE = TokenStyle(
    "<end_of_turn>", "<pad>", ("<bos>", "<eos>", "<start_of_turn>", "<start_of_image>", "<image_soft_token>",
                               "<end_of_image>"),
    "<bos>{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    + _content("<start_of_image>") + "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# LLaVA-1.5 style: "USER: <image>\ntext ASSISTANT:" (the processor repeats <image> once per patch feature)
LLAVA_STYLE = TokenStyle(
    "</s>", "<pad>", ("<s>", "<image>"),
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    + _content("<image>\n") + "{% if m['role'] == 'assistant' %}</s>{% else %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")

# PaliGemma: no roles and no image placeholders: the images are the prefix, put first by the processor (transformers':
# "<image>" * 16 per image, <bos>, the text, "\n"; vLLM's inserts the same itself, and keeps any "<image>" of the text
# as a stray extra token); a response ends with <eos>
PALIGEMMA_STYLE = TokenStyle(
    "<eos>", "<pad>", ("<bos>", "<image>"),
    "{% for m in messages %}{% if m['role'] == 'user' %}" + _content("") + "{% else %}" + _content("")
    + "<eos>{% endif %}{% endfor %}")

# InternVL (Hugging Face format): ChatML, each image as <IMG_CONTEXT>, which the processor expands to
# <img><IMG_CONTEXT>*N</img> per tile
INTERNVL_STYLE = TokenStyle(
    "<|im_end|>", "<|endoftext|>", ("<|im_start|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + _content("<IMG_CONTEXT>\n") + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# GLM-4.1V: [gMASK]<sop><|user|>\n...<|assistant|>\n, each image as <|begin_of_image|><|image|><|end_of_image|>
GLM4V_STYLE = TokenStyle(
    "<|user|>", "<|endoftext|>", ("[gMASK]", "<sop>", "<|assistant|>", "<|system|>", "<|begin_of_image|>",
                                  "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
                                  "<|end_of_video|>"),
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n" + _content("<|begin_of_image|><|image|><|end_of_image|>")
    + "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# LFM2-VL: <|startoftext|> + ChatML, each image as <image> (the processor wraps the expanded tokens in
# <|image_start|> ... <|image_end|>)
LFM2_VL_STYLE = TokenStyle(
    "<|im_end|>", "<|pad|>", ("<|startoftext|>", "<|im_start|>", "<image>", "<|image_start|>", "<|image_end|>",
                              "<|img_thumbnail|>", *(f"<|img_row_{i}_col_{j}|>" for i in range(1, 4)
                                                     for j in range(1, 4))),
    "<|startoftext|>{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + _content("<image>")
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Mistral 3 (Pixtral tower): <s>[INST]...[/INST]; each image as [IMG], expanded by the processor to rows of [IMG]
# separated by [IMG_BREAK] and closed by [IMG_END]
MISTRAL3_STYLE = TokenStyle(
    "</s>", "<pad>", ("<s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"),
    "<s>{% for m in messages %}{% if m['role'] == 'user' %}[INST]" + _content("[IMG]")
    + "[/INST]{% else %}" + _content("") + "</s>{% endif %}{% endfor %}")


@dataclass(frozen=True)
class VlmFamily:
    """One family: what it exercises, its tokens and template, ``build(ids, vocab) -> (config, make_processor)``
    given the special tokens' ids and the vocabulary size, and what it takes to load in both libraries."""

    what: str
    style: TokenStyle
    build: Callable[[dict[str, int], int], tuple]
    #: per image of IMAGE_SIZES: (tokens carrying image features, tokens the image adds to the prompt in all)
    image_tokens: tuple[tuple[int, int], ...]
    max_images: int = 2  # images per prompt the survey sends (vLLM's PaliGemma takes one)
    named: dict[str, str] | None = None  # tokenizer attributes the processor reads (boi_token, image_token, ...)
    added: tuple[str, ...] = ()  # plain (not special) tokens added to the vocabulary as whole strings
    #: fix-ups of transformers 5's ``save_pretrained`` output into the layout of published checkpoints, which vLLM
    #: loads (``PUBLISHED``): "tower" (CLIP/SigLIP towers), "experts" (Qwen3-VL-MoE's fused experts)
    published: tuple[str, ...] = ()
    #: token_type_ids of generated tokens (PaliGemma: 1, the causal suffix after its bidirectional prefix)
    response_token_type: int = 0
    #: families whose transformers model attends bidirectionally within images (Gemma 3) or the prefix (PaliGemma):
    #: the token_type_ids that, given at every position, make it attend causally, as vLLM's CPU backend does
    causal_token_type: int | None = None
    text_only: bool = True  # the processor takes a prompt without images (PaliGemma's does not)
    vllm_settings: dict = field(default_factory=dict)  # vllm.LLM arguments the family needs


def _qwen2_vl(ids, vocab):
    from transformers import Qwen2VLConfig, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    text = dict(TEXT, vocab_size=vocab, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                bos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                    "rope_theta": 10000.0})
    text.pop("head_dim")  # Qwen2-VL's text config derives it (64 / 2)
    vis = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=1, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
               temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vis, tie_word_embeddings=False, **_qwen_ids(ids))
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    return cfg, lambda tok: Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size), tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size), chat_template=tok.chat_template)


def _qwen2_5_vl(ids, vocab):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    text = dict(TEXT, vocab_size=vocab, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                bos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                    "rope_theta": 10000.0})
    text.pop("head_dim")
    # window_size 56 px = 2x2 merged patches: the 6x4 grids of the test images span several windows
    vis = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=64, patch_size=14,
               spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vis, tie_word_embeddings=False, **_qwen_ids(ids))
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    return cfg, lambda tok: Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size), tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(size=size), chat_template=tok.chat_template)


def _qwen3_vl(moe: bool):
    def build(ids, vocab):
        from transformers import (
            Qwen2VLImageProcessor,
            Qwen3VLConfig,
            Qwen3VLMoeConfig,
            Qwen3VLProcessor,
            Qwen3VLVideoProcessor,
        )

        text = dict(TEXT, vocab_size=vocab, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
                    bos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5],
                                                        "mrope_interleaved": True, "rope_theta": 10000.0})
        if moe:  # 4 experts, 2 a token, in both layers; 2 x 16 != 64, so that no expert matrix is square (a square
            # one would make transformers' load-time transpose check, which compares shapes, ambiguous)
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                        norm_topk_prob=True, tie_word_embeddings=False)
        # 64 learned position embeddings (an 8x8 grid, interpolated to the image's), deep-stack features of layer 0
        vis = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=64, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                   deepstack_visual_indexes=[0])
        cfg = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(text_config=text, vision_config=vis,
                                                            tie_word_embeddings=False, **_qwen_ids(ids))
        size = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
        mean = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3)
        return cfg, lambda tok: Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessor(size=size, patch_size=16, **mean), tokenizer=tok,
            video_processor=Qwen3VLVideoProcessor(size=size, patch_size=16, **mean), chat_template=tok.chat_template)
    return build


def _qwen_ids(ids):
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _idefics(kind):
    def build(ids, vocab):
        from transformers import (
            Idefics3Config,
            Idefics3ImageProcessor,
            Idefics3Processor,
            SmolVLMConfig,
            SmolVLMImageProcessor,
            SmolVLMProcessor,
            SmolVLMVideoProcessor,
        )

        text = dict(TEXT, model_type="llama", vocab_size=vocab, eos_token_id=ids["<end_of_utterance>"],
                    pad_token_id=ids["<|endoftext|>"], bos_token_id=None)
        # 32 px tiles of 8 px patches: 16 patches, pixel-shuffled (scale 2) into 4 tokens per tile
        vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, image_size=32,
                   patch_size=8)
        config, ip, proc = ((Idefics3Config, Idefics3ImageProcessor, Idefics3Processor) if kind == "idefics3" else
                            (SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor))
        cfg = config(text_config=text, vision_config=vis, scale_factor=2, image_token_id=ids["<image>"],
                     tie_word_embeddings=False, pad_token_id=ids["<|endoftext|>"])
        # images are resized to a longest edge of 64 px and split into 32 px tiles, plus the whole image at 32 px
        return cfg, lambda tok: proc(
            image_processor=ip(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                               do_image_splitting=True),
            tokenizer=tok, image_seq_len=4, chat_template=tok.chat_template,
            **({} if kind == "idefics3" else {"video_processor": SmolVLMVideoProcessor()}))
    return build


def _gemma3(ids, vocab):
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    text = dict(TEXT, vocab_size=vocab, eos_token_id=[ids["<end_of_turn>"], ids["<eos>"]], pad_token_id=ids["<pad>"],
                bos_token_id=ids["<bos>"], query_pre_attn_scalar=32, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])
    # 32 px images of 8 px patches: 16 patches, average-pooled 2x2 into 4 tokens
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, image_size=32,
               patch_size=8, vision_use_head=False)
    cfg = Gemma3Config(text_config=text, vision_config=vis, mm_tokens_per_image=4,
                       image_token_id=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                       eoi_token_index=ids["<end_of_image>"], tie_word_embeddings=True)
    return cfg, lambda tok: Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok, image_seq_length=4,
        chat_template=tok.chat_template)


def _llava(ids, vocab):
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaProcessor

    text = dict(TEXT, model_type="llama", vocab_size=vocab, eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                bos_token_id=ids["<s>"])
    # 28 px images of 7 px patches: 16 patch features (CLS dropped by the "default" strategy)
    vis = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=1, image_size=28, patch_size=7, projection_dim=32)
    cfg = LlavaConfig(text_config=text, vision_config=vis, image_token_id=ids["<image>"], vision_feature_layer=-1,
                      vision_feature_select_strategy="default", tie_word_embeddings=False)
    return cfg, lambda tok: LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok, patch_size=7, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=tok.chat_template)


def _llava_next(ids, vocab):
    from transformers import LlavaNextConfig, LlavaNextImageProcessor, LlavaNextProcessor

    text = dict(TEXT, model_type="llama", vocab_size=vocab, eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                bos_token_id=ids["<s>"])
    vis = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=1, image_size=28, patch_size=7, projection_dim=32)
    # "anyres": the image resized to the best of these resolutions and cut into 28 px crops, plus the whole image at
    # 28 px; crop features are unpadded to the image's aspect ratio, each row ended by the learned image_newline
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    cfg = LlavaNextConfig(text_config=text, vision_config=vis, image_token_id=ids["<image>"], vision_feature_layer=-1,
                          vision_feature_select_strategy="default", image_grid_pinpoints=pinpoints,
                          tie_word_embeddings=False)
    return cfg, lambda tok: LlavaNextProcessor(
        image_processor=LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                image_grid_pinpoints=pinpoints),
        tokenizer=tok, patch_size=7, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=tok.chat_template)


def _paligemma(ids, vocab):
    from transformers import PaliGemmaConfig, PaliGemmaProcessor, SiglipImageProcessor

    text = dict(TEXT, model_type="gemma", vocab_size=vocab, eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
                bos_token_id=ids["<bos>"])
    # 32 px images of 8 px patches: 16 tokens, no pooling
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, image_size=32,
               patch_size=8, vision_use_head=False)
    cfg = PaliGemmaConfig(text_config=text, vision_config=vis, image_token_index=ids["<image>"], projection_dim=64,
                          hidden_size=64, vocab_size=vocab, pad_token_id=ids["<pad>"], tie_word_embeddings=True)

    def processor(tok):
        ip = SiglipImageProcessor(size={"height": 32, "width": 32})
        ip.image_seq_length = 16
        return PaliGemmaProcessor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template)
    return cfg, processor


def _internvl(ids, vocab):
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    text = dict(TEXT, model_type="qwen2", vocab_size=vocab, eos_token_id=ids["<|im_end|>"],
                pad_token_id=ids["<|endoftext|>"], bos_token_id=None)
    # 32 px tiles of 8 px patches: 16 patches, pixel-shuffled (ratio 0.5) into 4 tokens per tile; an image is cut
    # into up to 4 tiles of its aspect ratio plus a thumbnail
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, image_size=32,
               patch_size=8)
    cfg = InternVLConfig(text_config=text, vision_config=vis, image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=4,
                         downsample_ratio=0.5, tie_word_embeddings=False)
    ip = dict(size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1, max_patches=4)
    return cfg, lambda tok: InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(**ip), tokenizer=tok,
        video_processor=InternVLVideoProcessor(size={"height": 32, "width": 32}), image_seq_length=4,
        chat_template=tok.chat_template)


def _glm4v(ids, vocab):
    from transformers import Glm4vConfig, Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    # partial rotary (half of each head: 16 of 32 dims) in 3-D M-RoPE sections
    text = dict(TEXT, vocab_size=vocab, eos_token_id=[ids["<|user|>"], ids["<|endoftext|>"]],
                pad_token_id=ids["<|endoftext|>"],
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5,
                                 "rope_theta": 10000.0})
    text.pop("head_dim")
    vis = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=1, out_hidden_size=64, image_size=56,
               patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Glm4vConfig(text_config=text, vision_config=vis, image_token_id=ids["<|image|>"],
                      video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                      image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                      video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=False)
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    return cfg, lambda tok: Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=size), tokenizer=tok,
        video_processor=Glm4vVideoProcessor(size=size), chat_template=tok.chat_template)


def _lfm2_vl(ids, vocab):
    from transformers import Lfm2VlConfig, Lfm2VlImageProcessor, Lfm2VlProcessor

    # LFM2's hybrid LM (short convolutions, then attention); conv_dim and block_dim: fields of LiquidAI's config.json
    # that vLLM reads
    text = dict(TEXT, model_type="lfm2", vocab_size=vocab, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|pad|>"],
                bos_token_id=ids["<|startoftext|>"], layer_types=["conv", "full_attention"], conv_dim=64, block_dim=64,
                tie_word_embeddings=True)
    # SigLIP2 NaFlex tower: 16 px patches at the image's own aspect ratio (position embeddings of an 8x8 grid
    # interpolated), pixel-unshuffled 2x2
    vis = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=1, patch_size=16, num_patches=64, vision_use_head=False)
    cfg = Lfm2VlConfig(text_config=text, vision_config=vis, image_token_id=ids["<image>"], projector_hidden_size=64,
                       downsample_factor=2, tie_word_embeddings=True)
    ip = dict(do_image_splitting=False, min_image_tokens=4, max_image_tokens=16, encoder_patch_size=16,
              tile_size=64, downsample_factor=2, max_num_patches=64)
    return cfg, lambda tok: Lfm2VlProcessor(image_processor=Lfm2VlImageProcessor(**ip), tokenizer=tok,
                                            chat_template=tok.chat_template)


def _mistral3(ids, vocab):
    from transformers import Mistral3Config, PixtralImageProcessor, PixtralProcessor

    text = dict(TEXT, model_type="mistral", vocab_size=vocab, eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
                bos_token_id=ids["<s>"], sliding_window=None)
    # images resized to a longest edge of 48 px (sides rounded up to 16 px) in 8 px patches, merged 2x2: 84x56 is
    # a 6x4 patch grid, 3x2 tokens, each row ended by [IMG_BREAK], the last by [IMG_END]: 8 tokens (56x84: 9)
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1, head_dim=32,
               image_size=48, patch_size=8)
    cfg = Mistral3Config(text_config=text, vision_config=vis, image_token_index=ids["[IMG]"], spatial_merge_size=2,
                         vision_feature_layer=-1, tie_word_embeddings=False)
    return cfg, lambda tok: PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 48}, patch_size=16), tokenizer=tok,
        patch_size=8, spatial_merge_size=2, chat_template=tok.chat_template)


VLM_FAMILIES: dict[str, VlmFamily] = {
    "qwen2_vl": VlmFamily("M-RoPE (3-D positions), 2x2 patch merging, native-resolution grids", QWEN_VL_STYLE,
                          _qwen2_vl, ((6, 8), (6, 8))),
    "qwen2_5_vl": VlmFamily("windowed + full vision attention, SwiGLU tower, M-RoPE", QWEN_VL_STYLE, _qwen2_5_vl,
                            ((6, 8), (6, 8))),
    "qwen3_vl": VlmFamily("interleaved M-RoPE, deep-stack visual features added in the LM's layers",
                          QWEN_VL_STYLE, _qwen3_vl(moe=False), ((6, 8), (6, 8))),
    "qwen3_vl_moe": VlmFamily("Qwen3-VL with a mixture-of-experts LM (fused expert weights)", QWEN_VL_STYLE,
                              _qwen3_vl(moe=True), ((6, 8), (6, 8)), published=("experts",)),
    # SmolVLM's processor needs the num2words package
    "smolvlm": VlmFamily("image splitting into tiles + a global image, pixel-shuffle connector, padded tiles "
                         "(pixel_attention_mask)", SMOLVLM_STYLE, _idefics("smolvlm"), ((20, 33), (20, 33))),
    "idefics3": VlmFamily("image splitting into tiles + a global image, pixel-shuffle connector, padded tiles "
                          "(pixel_attention_mask)", IDEFICS3_STYLE, _idefics("idefics3"), ((20, 33), (20, 33))),
    "gemma3": VlmFamily("SigLIP tower, pooled soft tokens, bidirectional attention within an image, local/global "
                        "LM layers", GEMMA3_STYLE, _gemma3, ((4, 7), (4, 7)),
                        named={"bos_token": "<bos>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                               "image_token": "<image_soft_token>"},
                        # vLLM's Gemma 3 processor looks up "\n" ... "\n\n\n\n" in the vocabulary (single tokens in
                        # Gemma's SentencePiece vocabulary) to merge the newlines around an image as the tokenizer does
                        added=("\n", "\n\n", "\n\n\n", "\n\n\n\n"), published=("tower",), causal_token_type=0),
    "llava": VlmFamily("CLIP tower, MLP projector", LLAVA_STYLE, _llava, ((16, 17), (16, 17)), published=("tower",)),
    "llava_next": VlmFamily("CLIP tower, any-resolution crops with unpadding and image_newline", LLAVA_STYLE,
                            _llava_next, ((70, 71), (72, 73)), published=("tower",)),
    "paligemma": VlmFamily("SigLIP tower, prefix-LM (bidirectional over images + prompt), Gemma LM", PALIGEMMA_STYLE,
                           _paligemma, ((16, 18), (16, 18)), max_images=1,
                           named={"bos_token": "<bos>", "image_token": "<image>"},
                           added=("\n",),  # vLLM's PaliGemma processor ends the prefix with the vocabulary's "\n"
                           published=("tower",), response_token_type=1, causal_token_type=1, text_only=False),
    "internvl": VlmFamily("InternViT tower, tiles + thumbnail, pixel-shuffle MLP projector", INTERNVL_STYLE,
                          _internvl, ((20, 23), (12, 15)),
                          named={"start_image_token": "<img>", "end_image_token": "</img>",
                                 "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}),
    "glm4v": VlmFamily("GLM-4.1V: M-RoPE with partial rotary, learned + interpolated tower positions",
                       GLM4V_STYLE, _glm4v, ((6, 8), (6, 8))),
    "lfm2_vl": VlmFamily("SigLIP2 NaFlex tower (native aspect ratio, padded patches), hybrid conv/attention LM",
                         LFM2_VL_STYLE, _lfm2_vl, ((6, 8), (6, 8)), published=("tower",)),
    "mistral3": VlmFamily("Pixtral tower (2-D RoPE), patch merger, [IMG_BREAK]/[IMG_END] rows", MISTRAL3_STYLE,
                          _mistral3, ((6, 8), (6, 9))),
}


def tokenizer_for(family: str):
    """The project's BPE tokenizer with ``family``'s special tokens and chat template (a ``TextTokenizer``)."""
    from engines.model.text.tokenizer import TextTokenizer, train_tokenizer
    from envs.arithmetic import ArithmeticEnv

    fam = VLM_FAMILIES[family]
    tasks = ArithmeticEnv.generate_tasks(300, seed=11)
    tok = train_tokenizer([t.prompt + t.meta["solution"] for t in tasks], vocab_size=400, style=fam.style)
    if fam.named:  # rebuilt with named special tokens, which tokenizer_config.json keeps
        from transformers import PreTrainedTokenizerFast

        h = tok.hf
        tok = TextTokenizer(PreTrainedTokenizerFast(
            tokenizer_object=h.backend_tokenizer, eos_token=h.eos_token, pad_token=h.pad_token,
            model_max_length=h.model_max_length, clean_up_tokenization_spaces=False, chat_template=h.chat_template,
            extra_special_tokens=dict(fam.named)))
    if fam.added:
        from tokenizers import AddedToken

        tok.hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in fam.added])
    return tok


@torch.no_grad()
def sharpen(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Redraw every matrix and embedding as N(0, ``std``) (as ``tests.hf_families.sharpen``), convolution kernels
    (patch embeddings) too, so that logits are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    for _, p in model.named_parameters():
        if p.ndim >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def build_tiny_vlm(family: str, seed: int = 0):
    """(model, processor) of ``family``: a sharpened tiny random model and its processor."""
    from transformers import AutoModelForImageTextToText

    fam = VLM_FAMILIES[family]
    tok = tokenizer_for(family).hf
    ids = {s: tok.convert_tokens_to_ids(s) for s in fam.style.specials}
    _, make_processor = fam.build(ids, len(tok))
    processor = make_processor(tok)  # first: it may add tokens (PaliGemma's <locNNNN>, <segNNN>)
    cfg, _ = fam.build(ids, len(processor.tokenizer))
    torch.manual_seed(seed)
    model = sharpen(AutoModelForImageTextToText.from_config(cfg), seed=seed)
    return model, processor


def save_tiny_vlm(family: str, directory: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Save ``family``'s tiny model (``save_pretrained`` in ``dtype``, then the family's ``published`` fix-ups) and
    its processor (image processor, tokenizer, chat template) in ``directory``."""
    d = Path(directory)
    model, processor = build_tiny_vlm(family, seed)
    model.to(dtype).save_pretrained(d)
    if VLM_FAMILIES[family].published:
        to_published_layout(d, VLM_FAMILIES[family].published)
    processor.save_pretrained(d)
    return d


def _tower(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``vision_tower.X`` -> ``vision_tower.vision_model.X``.

    transformers 5 flattened ``CLIPVisionModel``/``SiglipVisionModel`` (no ``vision_model`` submodule). It loads the
    published layout through a prefix change in its conversion mapping and re-saves a model loaded that way in it,
    but saves a model built from a config flat, while vLLM 0.32's towers (which keep ``vision_model``) load only the
    published layout: "There is no module or parameter named 'vision_tower.embeddings'"."""
    return re.sub(r"^((?:model\.)?vision_tower\.)(?!vision_model\.)", r"\1vision_model.", name), t


def _experts(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Fused expert weights ``mlp.experts.{gate_up,down}_proj`` transposed to the published [experts, in, out].

    transformers 5.19 holds them as [experts, out, in] and transposes published checkpoints on load when the shapes
    differ (``Transpose(check_dims=True)``), but the reverse on save compares the parameter with itself, so never
    transposes: ``save_pretrained`` writes [experts, out, in], which vLLM 0.32 cannot load ("The size of tensor a
    (32) must match the size of tensor b (64)")."""
    if re.search(r"mlp\.experts\.(gate_up|down)_proj$", name):
        return name, t.transpose(1, 2).contiguous()
    return name, t


#: fix-up name -> (weight name, tensor) -> (published name, tensor)
PUBLISHED: dict[str, Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]] = {"tower": _tower, "experts": _experts}


def to_published_layout(directory: str | Path, fixups: tuple[str, ...]) -> None:
    """Rewrite the safetensors weights (and index) saved in ``directory`` with the ``PUBLISHED`` fix-ups named."""
    import json

    from safetensors.torch import load_file, save_file

    def fix(name, t):
        for f in fixups:
            name, t = PUBLISHED[f](name, t)
        return name, t

    d = Path(directory)
    for path in sorted(d.glob("*.safetensors")):
        save_file(dict(fix(k, v) for k, v in load_file(path).items()), path, metadata={"format": "pt"})
    index = d / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {fix(k, torch.empty(0, 0, 0))[0]: v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
