"""The model's own image processing: its image processor, tokenizer and chat template, without torchvision.

transformers 5 builds a Qwen-VL ``AutoProcessor`` only with a video processor, which needs torchvision (PyPI has no
CPU build of it for recent torch). Images need none of that: ``AutoImageProcessor`` gives the PIL image processor
where torchvision is absent, and the one step the processor adds (each image's placeholder expanded into the
image's tokens) is done here. So a prompt exists in two forms:

- engine ids: the chat template's rendering, ONE placeholder per image; vLLM takes these with the images and
  expands them itself (sending expanded ids with the images expands them twice: trl#6294, trl#6401);
- model ids: each placeholder expanded; the trainer and the HF engine use these, with the image processor's
  features. Qwen-VL: the placeholder repeated t * h * w / merge^2 times (on ids; ``pixel_values``, ``image_grid_thw``).
  Gemma-3: the placeholder (its begin-of-image token) replaced in the prompt's text by "\n\n", the begin token,
  ``mm_tokens_per_image`` image tokens, the end token and "\n\n", and the text tokenized again, as its processor does
  (the newlines may merge with the text's own; ``pixel_values`` of the tower's fixed size, pan-and-scan off).

The k-th ``<image>`` of a prompt's text is its k-th image (verl's layout); a count mismatch is a bad row.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from transformers import AutoImageProcessor

from lib.vision import family, merge_size

PLACEHOLDER = "<image>"
"""Where an image sits in a prompt's text (verl's geo3k layout; TRL's image columns are placed before the text)."""


def image_parts(content: str) -> list[dict]:
    """A message's text with ``<image>`` placeholders -> chat content parts, images in order."""
    parts: list[dict] = []
    for k, piece in enumerate(content.split(PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def count_placeholders(prompt: Any) -> int:
    if isinstance(prompt, str):
        return prompt.count(PLACEHOLDER)
    return sum(m["content"].count(PLACEHOLDER) for m in prompt if isinstance(m.get("content"), str))


def with_image_parts(messages: list[dict]) -> list[dict]:
    """Chat messages whose string contents hold ``<image>`` -> contents as parts the VL chat templates render."""
    return [{**m, "content": image_parts(m["content"])} if PLACEHOLDER in m.get("content", "") else m
            for m in messages]


def _source(entry: Any) -> tuple[bytes | None, str | None]:
    """(bytes, path) of an image entry that is not a PIL image; ValueError for anything else."""
    if isinstance(entry, dict):
        data, path = entry.get("bytes"), entry.get("path")
    elif isinstance(entry, (bytes, bytearray)):
        data, path = entry, None
    elif isinstance(entry, str):
        data, path = None, entry
    else:
        raise ValueError(f"an image must be a {{'bytes', 'path'}} struct, a path or bytes, not {type(entry).__name__}")
    if not data and not path:
        raise ValueError("an image entry with neither bytes nor a path")
    return data, path


def _read(entry: Any, base_dir: str) -> Image.Image:
    """An image entry opened and decoded whole (see ``load_image``); ValueError saying what it was where it cannot
    be."""
    if isinstance(entry, Image.Image):
        image, what = entry, "a PIL image"
    else:
        data, path = _source(entry)
        what = f"{len(data)} bytes" if data else f"path {path!r}"
        try:
            image = (Image.open(io.BytesIO(data)) if data else
                     Image.open(path if os.path.isabs(path) or not base_dir else os.path.join(base_dir, path)))
        except UnidentifiedImageError:  # PIL's message names its BytesIO object, not the image
            raise ValueError(f"image ({what}) is in no format PIL reads (PNG, JPEG, WebP, GIF, ...)") from None
        except (OSError, Image.DecompressionBombError) as e:
            raise ValueError(f"image ({what}) cannot be read: {e}") from None
    try:
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"image ({what}) cannot be decoded: {e}") from None
    return image


def load_image(entry: Any, base_dir: str = "") -> Image.Image:
    """An image of a data row, as RGB: a ``{"bytes", "path"}`` struct (verl's and ``datasets``' Image layout: PNG or
    JPEG bytes, else a path relative to the data file), a path, raw bytes, or a PIL image. An unreadable one is a
    ValueError saying what it was."""
    return _read(entry, base_dir).convert("RGB")


def image_size(entry: Any, base_dir: str = "") -> tuple[int, int]:
    """(width, height) of an image decoded whole: the start-up check of the data reads every image this way, so a
    file cut short after its header (a truncated PNG or JPEG) is a bad row named there, not a rank's crash at the
    step that draws it (issue 59)."""
    return _read(entry, base_dir).size


class VisionProcessor:
    """The image side of a vision-language model: pixel bounds as configured (the same for rollout and training).
    ``placeholder_id``: the token prompts hold once per image (engine ids); ``image_token_id``: the model's image token
    (model ids). Qwen-VL: the same token."""

    def __init__(self, path: str, config: Any, tokenizer: Any, min_pixels: int = 0, max_pixels: int = 0,
                 trust_remote_code: bool = False):
        self.family = family(config)
        kwargs = {}
        if min_pixels or max_pixels:  # Qwen-VL's (a fixed-size family is refused them at start-up)
            probe = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
            size = dict(probe.size) if isinstance(getattr(probe, "size", None), dict) else {
                "shortest_edge": probe.size.shortest_edge, "longest_edge": probe.size.longest_edge}
            kwargs["size"] = {"shortest_edge": min_pixels or size["shortest_edge"],
                              "longest_edge": max_pixels or size["longest_edge"]}
        self.image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                                  **kwargs)
        self.tokenizer = tokenizer
        self.image_token = self.family.placeholder
        self.placeholder_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.image_token_id = int(config.image_token_id)
        own = int(config.boi_token_id) if self.expansion == "text" else self.image_token_id
        if self.placeholder_id != own:
            raise ValueError(f"the tokenizer at {path} maps {self.image_token!r} to {self.placeholder_id}, the model's "
                             f"config to {own}: tokenizer and model do not belong together")
        if self.expansion == "repeat":
            self.merge = merge_size(config)
        elif self.expansion == "text":
            per_image = int(config.mm_tokens_per_image)
            soft, end = tokenizer.convert_ids_to_tokens([self.image_token_id, int(config.eoi_token_id)])
            self.sequence = f"\n\n{self.image_token}{soft * per_image}{end}\n\n"
        else:
            self.begin, self.end = int(config.boi_token_id), int(config.eoi_token_id)
            self.pool = int(config.vision_config.pooling_kernel_size)

    @property
    def expansion(self) -> str:
        return self.family.expansion

    def images(self, images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """A prompt's image features: ``pixel_values`` (Qwen-VL: patches x patch features, with ``image_grid_thw``
        (images, 3); Gemma-3: images x channels x size x size; Gemma-4: images x patches x patch features, padded to
        the patch budget, with ``image_position_ids`` (images x patches x 2, (-1, -1) on padding))."""
        if self.expansion == "text":
            return {"pixel_values": self.image_processor(images=images, do_pan_and_scan=False,
                                                         return_tensors="pt")["pixel_values"]}
        out = self.image_processor(images=images, return_tensors="pt")
        if self.expansion == "bracket":
            return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"].long()}
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def tokens_per_image(self, features: dict[str, torch.Tensor]) -> list[int]:
        """Each image's tokens, from its features (Qwen-VL, Gemma-4)."""
        if self.expansion == "bracket":
            return ((features["image_position_ids"] != -1).all(-1).sum(-1) // self.pool ** 2).tolist()
        return (features["image_grid_thw"].prod(-1) // self.merge ** 2).tolist()

    def tokens_for_size(self, width: int, height: int) -> int:
        """Tokens of an image of this size, from its header alone (Qwen-VL, Gemma-4)."""
        if self.expansion == "bracket":
            ip = self.image_processor
            return gemma4_tokens(height, width, ip.patch_size, ip.max_soft_tokens, ip.pooling_kernel_size)
        return self.image_processor.get_number_of_image_patches(height, width, {}) // self.merge ** 2

    def model_length(self, ids: list[int], text: str, sizes: list[tuple[int, int]]) -> int:
        """Tokens of a prompt (``ids``, rendered from ``text``) once its images (``sizes``: (width, height) each) are
        expanded, read from the images' headers alone."""
        if self.expansion == "text":
            return len(self.expand(ids, text))
        brackets = 2 if self.expansion == "bracket" else 0
        return len(ids) + sum(self.tokens_for_size(w, h) - 1 + brackets for w, h in sizes)

    def expand(self, ids: list[int], text: str, features: dict[str, torch.Tensor] | None = None) -> list[int]:
        """Engine ids (one placeholder per image, rendered from ``text``) -> model ids (each image expanded)."""
        if self.expansion == "text":
            return self.tokenizer(text.replace(self.image_token, self.sequence), add_special_tokens=False)["input_ids"]
        counts = iter(self.tokens_per_image(features))
        out: list[int] = []
        for token in ids:
            if token != self.placeholder_id:
                out.append(token)
            elif self.expansion == "bracket":
                out.extend([self.begin] + [token] * next(counts) + [self.end])
            else:
                out.extend([token] * next(counts))
        return out


def gemma4_tokens(height: int, width: int, patch: int, max_tokens: int, pool: int) -> int:
    """Gemma-4's tokens for an image of this size: resized, aspect kept, to the largest size of at most
    ``max_tokens * pool^2`` patches whose sides are multiples of ``pool * patch`` (a side that rounds to nothing takes
    one such unit, a wide image's other side then ``floor(ratio)`` units), then ``pool x pool`` patches per token, at
    most ``max_tokens`` (a very tall image's patches past the budget are dropped)."""
    unit = pool * patch
    scale = math.sqrt(max_tokens * pool ** 2 * patch ** 2 / (height * width))
    rows, cols = math.floor(scale * height / unit), math.floor(scale * width / unit)  # their product is ~max_tokens:
    if rows == 0:  # never both 0
        rows, cols = 1, min(math.floor(width / height), max_tokens)
    elif cols == 0:
        cols = 1
    return min(rows * cols, max_tokens)
