"""A vision-language model's own processor: its chat template for prompts with images, and the expansion of each
image placeholder into the tokens the model reads, with the pixel tensors that go with them.

Prompts live as **template ids** everywhere before the model: the chat template renders one placeholder token per
image (``<|image_pad|>``, ``<image>``, ...), exactly what vLLM takes with ``multi_modal_data`` (it expands them
itself). The trainer's forward needs them **expanded**: ``VisionProcessor.expand`` replaces the i-th placeholder by
the processor's own replacement for image i (``replace_image_token``: a run of image tokens, or a grid with row and
column markers) and returns the image processor's tensors (``pixel_values``, ``image_grid_thw``,
``pixel_attention_mask``, ...) and the multimodal token types, as ``processor(text=..., images=...)`` would give
them for the same prompt (tests check the two agree per family). ``expanded_length`` is the token count a prompt
costs the context and the budget, known before rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.model.images import ImageRef, decoded

__all__ = ["Expanded", "VisionProcessor", "VisionPromptError", "is_vision_dir"]


class VisionPromptError(ValueError):
    """A prompt with images that the model cannot take (the message says which and why)."""


def is_vision_dir(directory: str | Path) -> bool:
    """Whether a model directory holds a vision-language model (an image processor config beside the weights, or
    a ``vision_config`` in its config)."""
    import json

    d = Path(directory)
    if (d / "preprocessor_config.json").is_file():
        return True
    cfg = d / "config.json"
    return cfg.is_file() and "vision_config" in json.loads(cfg.read_text())


@dataclass
class Expanded:
    """One prompt ready for the model: ``ids`` (placeholders expanded), ``media`` (the image processor's tensors
    for its images, as the model's forward takes them) and ``mm_token_type_ids`` (1 on image tokens)."""

    ids: list[int]
    media: dict[str, torch.Tensor]
    mm_token_type_ids: list[int]
    #: for each token of ``ids``, the index of the template id it comes from (an image's tokens: its placeholder's)
    origin: list[int] = field(default_factory=list)


class VisionProcessor:
    """transformers' ``AutoProcessor`` of a vision-language model (see the module docstring)."""

    def __init__(self, processor: Any, source: str = "processor") -> None:
        self.hf, self.source = processor, source
        if getattr(processor, "image_processor", None) is None:
            raise VisionPromptError(f"{source}: the processor has no image processor")
        self.tokenizer = processor.tokenizer
        self.image_token: str = getattr(processor, "image_token", None) or ""
        if not self.image_token:
            raise VisionPromptError(f"{source}: the processor names no image placeholder token (image_token)")
        token_id = getattr(processor, "image_token_id", None)
        self.image_token_id: int = token_id if token_id is not None else \
            self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.max_images: int | None = None  # the model's limit per prompt, when the run sets one
        self._counts_by_size: bool | None = None  # whether image sizes alone give the token counts (None: unknown)

    @classmethod
    def load(cls, directory: str | Path, trust_remote_code: bool = False) -> VisionProcessor:
        """The processor saved in a model directory (``processor_config.json`` / ``preprocessor_config.json``)."""
        from transformers import AutoProcessor

        try:
            hf = AutoProcessor.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
        except Exception as e:  # transformers raises many types for a broken processor directory
            raise VisionPromptError(f"{directory}: transformers cannot load the processor ({e})") from e
        return cls(hf, source=str(directory))

    # ---- prompts ----------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Template ids of ``messages`` (content parts ``{"type": "image"}`` become one placeholder each), rendered
        by the processor's chat template (the tokenizer's when the processor has none)."""
        template = getattr(self.hf, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise VisionPromptError(f"{self.source} has no chat template, so prompts with images cannot be rendered")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def placeholders(self, ids: Sequence[int]) -> int:
        """How many image placeholders template ids hold."""
        return sum(1 for t in ids if t == self.image_token_id)

    def check(self, ids: Sequence[int], images: Sequence[Any], where: str) -> None:
        """VisionPromptError unless ``ids`` hold one placeholder per image, within the model's limit."""
        n = self.placeholders(ids)
        if n != len(images):
            raise VisionPromptError(f"{where}: the prompt has {n} image placeholder(s) but {len(images)} image(s)")
        if self.max_images is not None and len(images) > self.max_images:
            raise VisionPromptError(f"{where}: {len(images)} images, more than the model's limit of "
                                    f"{self.max_images} per prompt")

    def process_images(self, pil_images: Sequence[Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The image processor's tensors for ``pil_images`` and each image's replacement text, with the processor's
        own default keyword arguments (what its ``__call__`` uses)."""
        merged = self.hf._merge_kwargs(self.hf.valid_processor_kwargs,
                                       tokenizer_init_kwargs=self.tokenizer.init_kwargs, return_tensors="pt")
        processed, replacements = self.hf._process_images(list(pil_images), **merged["images_kwargs"])
        media = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for k, v in processed.items()
                 if k not in getattr(self.hf, "unused_input_names", ())}
        return media, replacements

    def expand(self, ids: Sequence[int], images: Sequence[Any], where: str = "prompt",
               at: Sequence[int] | None = None) -> Expanded:
        """Template ids with their images (``engines.model.images.ImageRef`` or PIL images) made into what the model's
        forward takes (see ``Expanded``). ``at``: the positions of the placeholders that are images (default: every
        one); another placeholder token stays as the text it is (type 0), as one a policy sampled."""
        if at is None:
            self.check(ids, images, where)
            at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        elif len(at) != len(images) or any(ids[i] != self.image_token_id for i in at):
            raise VisionPromptError(f"{where}: {len(at)} image position(s) for {len(images)} image(s)")
        elif self.max_images is not None and len(images) > self.max_images:
            raise VisionPromptError(f"{where}: {len(images)} images, more than the model's limit of "
                                    f"{self.max_images} per prompt")
        if not images:
            return Expanded(list(ids), {}, [0] * len(ids), list(range(len(ids))))
        pil = [decoded(im) for im in images]
        media, replacements = self.process_images(pil)
        out: list[int] = []
        origin: list[int] = []
        images_at = dict(zip(at, replacements, strict=True))
        for i, t in enumerate(ids):
            rep = self.tokenizer.encode(images_at[i], add_special_tokens=False) if i in images_at else [int(t)]
            out.extend(rep)
            origin.extend([i] * len(rep))
        # an image's tokens are typed as the processor types them; every other token is text (0), a placeholder
        # or video token the policy sampled included
        types = [int(x) if origin[j] in images_at else 0
                 for j, x in enumerate(self.hf.create_mm_token_type_ids([out])[0])]
        return Expanded(out, media, types, origin)

    def expanded_length(self, ids: Sequence[int], images: Sequence[Any], where: str = "prompt") -> int:
        """The number of tokens the model reads for template ids with their images. From the images' sizes alone
        (their headers) where the processor counts its tokens that way and its replacement is that many image
        tokens (checked against a full expansion the first time); otherwise by expanding."""
        if not images:
            return len(ids)
        if self._counts_by_size is not False and all(isinstance(im, ImageRef) for im in images):
            counted = self._tokens_by_size(images)
            if counted is not None:
                n = len(ids) - len(images) + sum(counted)
                if self._counts_by_size is None:  # the first time: the count must be the expansion's
                    self._counts_by_size = n == len(self.expand(ids, images, where).ids)
                if self._counts_by_size:
                    self.check(ids, images, where)
                    return n
        return len(self.expand(ids, images, where).ids)

    def _tokens_by_size(self, images: Sequence[Any]) -> list[int] | None:
        count = getattr(self.hf, "_get_num_multimodal_tokens", None)
        if count is None:
            self._counts_by_size = False
            return None
        try:
            data = count(image_sizes=[im.size()[::-1] for im in images])  # (height, width)
            return [int(n) for n in data["num_image_tokens"]]
        except (NotImplementedError, KeyError, TypeError, AttributeError):
            self._counts_by_size = False
            return None
