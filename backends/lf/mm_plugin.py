"""Images for vision-language models as LLaMA-Factory 0.9.5's mm plugins prepare them.

  regularize     MMPluginMixin._preprocess_image: scale down to image_max_pixels, up to image_min_pixels,
                 RGB; Qwen2-VL's plugin also lifts a side below 28 px and caps the aspect ratio at 200.
  expand         the `<image>` placeholders of the messages, in order, become the model's image tokens:
                 Qwen2VLPlugin: <|vision_start|> + <|image_pad|> × (t·h·w // merge²) + <|vision_end|>
                 Gemma3Plugin: the processor's full_image_sequence ("\\n\\n" boi, image soft tokens × n, eoi "\\n\\n")
  batch_inputs   the model inputs of a batch's images from the model's own image processor (Qwen:
                 pixel_values, image_grid_thw; Gemma3: pixel_values) plus the per-token type ids the HF
                 model needs (Qwen: mm_token_type_ids for M-RoPE; Gemma3: token_type_ids for the
                 bidirectional attention inside an image).

The processor is assembled from its parts (tokenizer, AutoImageProcessor, processor_config.json) rather
than through AutoProcessor, whose Qwen2-VL processor needs torchvision for a video processor we never use.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

IMAGE_PLACEHOLDER = "<image>"
QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl")
GEMMA_TYPES = ("gemma3",)
VL_TYPES = QWEN_TYPES + GEMMA_TYPES
# LLaMA-Factory template -> the model types its mm plugin serves
TEMPLATE_TYPES = {"qwen2_vl": QWEN_TYPES, "gemma3": GEMMA_TYPES}


class MediaError(ValueError):
    """A record whose images cannot be used; the message names the data file, the record and the image."""


def model_type(path: str | Path) -> str | None:
    """config.json's model_type (None when there is none to read)."""
    try:
        return json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


def is_vl(path: str | Path) -> bool:
    return model_type(path) in VL_TYPES


def regularize(image, max_pixels: int, min_pixels: int, qwen: bool):
    """One PIL image as LLaMA-Factory's _preprocess_image leaves it."""
    if image.width * image.height > max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    if image.width * image.height < min_pixels:
        factor = math.sqrt(min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    if image.mode != "RGB":
        image = image.convert("RGB")
    if qwen:
        if min(image.width, image.height) < 28:
            image = image.resize((max(image.width, 28), max(image.height, 28)))
        if image.width / image.height > 200:
            image = image.resize((image.height * 180, image.height))
        if image.height / image.width > 200:
            image = image.resize((image.width, image.width * 180))
    return image


def count_placeholders(messages: list[dict]) -> int:
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)


def check_placeholders(messages: list[dict], n_images: int, where: str) -> None:
    found = count_placeholders(messages)
    if found != n_images:
        raise MediaError(f"{where}: {found} {IMAGE_PLACEHOLDER} placeholder(s) in the messages but {n_images} "
                         f"image(s) in the images column; each image needs one {IMAGE_PLACEHOLDER} where it goes")


@dataclass
class VisionPlugin:
    kind: str                  # the model type (one of VL_TYPES)
    tokenizer: object
    image_processor: object
    max_pixels: int
    min_pixels: int
    image_token: str
    image_token_id: int
    merge_size: int = 2        # Qwen
    image_seq_length: int = 0  # Gemma3

    @property
    def qwen(self) -> bool:
        return self.kind in QWEN_TYPES

    def open(self, path: str | Path):
        from PIL import Image

        with Image.open(path) as img:
            img.load()
            return regularize(img, self.max_pixels, self.min_pixels, self.qwen)

    def image_strings(self, images: list) -> list[str]:
        """The text each image's placeholder becomes."""
        if not self.qwen:
            seq = self.image_token * self.image_seq_length
            return [f"\n\n{self.tokenizer.boi_token}{seq}{self.tokenizer.eoi_token}\n\n"] * len(images)
        if not images:
            return []
        grid = self.image_processor(images, return_tensors="pt")["image_grid_thw"]
        merge = self.merge_size ** 2
        return [f"<|vision_start|>{self.image_token * (int(thw.prod()) // merge)}<|vision_end|>" for thw in grid]

    def expand(self, messages: list[dict], images: list, where: str) -> list[dict]:
        """A copy of the messages with each placeholder replaced by its image's tokens, in order."""
        check_placeholders(messages, len(images), where)
        strings = iter(self.image_strings(images))
        out = []
        for message in messages:
            content = message["content"]
            while IMAGE_PLACEHOLDER in content:
                content = content.replace(IMAGE_PLACEHOLDER, next(strings), 1)
            out.append({**message, "content": content})
        return out

    def tokens_per_image(self, images: list) -> list[int]:
        return [s.count(self.image_token) for s in self.image_strings(images)]

    def batch_inputs(self, images: list, input_ids) -> dict:
        """The vision inputs of a batch: every image of its rows in row order, and the token types."""
        out = {}
        if images:
            feats = self.image_processor(images, return_tensors="pt")
            out["pixel_values"] = feats["pixel_values"]
            if self.qwen:
                out["image_grid_thw"] = feats["image_grid_thw"]
        types = (input_ids == self.image_token_id).long()
        out["mm_token_type_ids" if self.qwen else "token_type_ids"] = types
        return out


def load_plugin(path: str | Path, tokenizer, max_pixels: int, min_pixels: int) -> VisionPlugin:
    """The plugin for the VL model at `path` (its image processor and tokens)."""
    from transformers import AutoImageProcessor

    kind = model_type(path)
    if kind not in VL_TYPES:
        raise MediaError(f"{path}: model_type {kind!r} is not a vision-language model this engine trains "
                         f"({', '.join(VL_TYPES)})")
    try:
        images = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise MediaError(f"{path}: no image processor to read ({err}); a VL model directory needs its "
                         "preprocessor_config.json") from None
    token = getattr(tokenizer, "image_token", None) or ("<|image_pad|>" if kind in QWEN_TYPES else None)
    token_id = tokenizer.convert_tokens_to_ids(token) if token else None
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise MediaError(f"{path}: the tokenizer has no image token ({token!r})")
    plugin = VisionPlugin(kind, tokenizer, images, max_pixels, min_pixels, token, int(token_id))
    if kind in QWEN_TYPES:
        plugin.merge_size = int(images.merge_size)
    else:
        for attr in ("boi_token", "eoi_token"):
            if not getattr(tokenizer, attr, None):
                raise MediaError(f"{path}: the Gemma3 tokenizer does not name its {attr}")
        plugin.image_seq_length = int(_processor_config(path).get("image_seq_length", 256))
    return plugin


def _processor_config(path: str | Path) -> dict:
    file = Path(path) / "processor_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
