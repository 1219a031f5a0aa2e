"""MindSpeed-MM's mllm data for Qwen2.5-VL: records of `messages` (role / content, `<image>` placeholders in
the user turns) and an `images` list of files (relative to dataset_dir), encoded as its `qwen2vl` template
does (LLaMA-Factory's qwen2_vl: ChatML with the default system prompt; every <image> becomes
<|vision_start|> + one <|image_pad|> per merged patch + <|vision_end|>). Images go through the model's
Qwen2-VL image processor, resized into [image_min_pixels, image_max_pixels] (dynamic resolution).
Labels: only the assistant turns' tokens; the prompt (system, user turns, image tokens) is never trained.
Batches are variable length: a micro-batch is its samples packed into one [1, T] row with cu_seqlens
(no padding, --variable-seq-lengths).

Bad data stops with one message naming the sample: a missing image file, a placeholder count that does
not match the images, an image that cannot fit image_max_pixels, a sample longer than --seq-length.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_SYSTEM = "You are a helpful assistant."
PLACEHOLDER = "<image>"


class DataError(ValueError):
    pass


@dataclass
class Sample:
    input_ids: list[int]
    labels: list[int]
    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor | None


def _load_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (data.json dataset_param.basic_parameters.dataset)")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        records = json.loads(text)
    except ValueError as err:
        raise DataError(f"data file {path} is not valid JSON ({err})") from None
    if not isinstance(records, list):
        raise DataError(f"data file {path}: expected a list of records")
    return records


class MLLMDataset:
    def __init__(self, data, tokenizer, image_processor, merge_size: int):
        """data: backends.mm.config.DataArgs."""
        self.d, self.tok, self.proc, self.merge = data, tokenizer, image_processor, merge_size
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
        if any(v is None or v == tokenizer.unk_token_id for v in ids.values()):
            raise DataError(f"the tokenizer in {data.processor_dir} lacks Qwen2-VL's vision tokens ({', '.join(ids)})")
        self.vision_start, self.image_pad, self.vision_end = ids.values()
        path = Path(data.dataset)
        records = _load_records(path)
        if data.max_samples:
            records = records[: data.max_samples]
        self.samples = [self._encode(i, r) for i, r in enumerate(records)]
        if not self.samples:
            raise DataError(f"data file {path} holds no samples")

    def _text(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False)

    def _images(self, index: int, files: list[str]):
        from PIL import Image

        d = self.d
        pixels, grids = [], []
        for name in files:
            f = Path(name) if Path(name).is_absolute() else Path(d.dataset_dir) / name
            if not f.is_file():
                raise DataError(f"sample {index}: image file {f} does not exist")
            try:
                img = Image.open(f).convert("RGB")
            except OSError as err:
                raise DataError(f"sample {index}: image {f} cannot be read ({err})") from None
            size = {"shortest_edge": max(d.image_min_pixels, 1), "longest_edge": d.image_max_pixels}
            try:
                out = self.proc(images=[img], return_tensors="pt", size=size)
            except ValueError as err:
                raise DataError(f"sample {index}: image {f} ({img.width}x{img.height}) cannot be resized into "
                                f"image_min_pixels..image_max_pixels = {d.image_min_pixels}..{d.image_max_pixels} "
                                f"({err})") from None
            grid = out["image_grid_thw"][0]
            patch = getattr(self.proc, "patch_size", 14)
            area = int(grid[1] * grid[2]) * patch * patch
            if area > d.image_max_pixels:
                raise DataError(f"sample {index}: image {f} needs {area} pixels after resizing, more than "
                                f"image_max_pixels {d.image_max_pixels} (the smallest Qwen2-VL image is "
                                f"{(patch * self.merge) ** 2} pixels); raise image_max_pixels in data.json")
            pixels.append(out["pixel_values"])
            grids.append(grid)
        if not pixels:
            return None, None
        return torch.cat(pixels), torch.stack(grids)

    def _encode(self, index: int, rec: dict) -> Sample:
        d = self.d
        messages = rec.get(d.messages)
        if not isinstance(messages, list) or not messages:
            raise DataError(f"sample {index}: no '{d.messages}' list of turns")
        files = rec.get(d.images) or []
        if isinstance(files, str):
            files = [files]
        n_marks = sum(str(m.get(d.content_tag, "")).count(PLACEHOLDER) for m in messages if isinstance(m, dict))
        if n_marks != len(files):
            raise DataError(f"sample {index}: {n_marks} {PLACEHOLDER} placeholder(s) but {len(files)} image(s) in "
                            f"'{d.images}'")
        pixel_values, grids = self._images(index, files)
        counts = [int(g.prod()) // self.merge ** 2 for g in grids] if grids is not None else []
        system, turns = DEFAULT_SYSTEM, []
        for m in messages:
            role, content = m.get(d.role_tag), str(m.get(d.content_tag, ""))
            if d.system_tag is not None and role == d.system_tag:
                system = content
            elif role in (d.user_tag, d.assistant_tag):
                turns.append((role == d.assistant_tag, content))
            else:
                raise DataError(f"sample {index}: role {role!r} is none of {d.user_tag!r}, {d.assistant_tag!r}"
                                + (f", {d.system_tag!r}" if d.system_tag else ""))
        ids = self._text(f"<|im_start|>system\n{system}<|im_end|>\n")
        labels = [-100] * len(ids)
        image = 0
        for is_answer, content in turns:
            if is_answer:
                piece = self._text(f"{content}<|im_end|>\n")
                ids += piece
                labels += piece
                continue
            parts = content.split(PLACEHOLDER)
            text = parts[0]
            for rest in parts[1:]:
                text += "<|vision_start|>" + "<|image_pad|>" * counts[image] + "<|vision_end|>" + rest
                image += 1
            piece = self._text(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
            ids += piece
            labels += [-100] * len(piece)
        if not any(x != -100 for x in labels):
            raise DataError(f"sample {index}: no assistant turn to train on")
        if len(ids) > d.seq_len:
            raise DataError(f"sample {index}: {len(ids)} tokens (images included) exceed --seq-length {d.seq_len}; "
                            "raise it or lower image_max_pixels")
        return Sample(ids, labels, pixel_values, grids)

    def __len__(self) -> int:
        return len(self.samples)


def collate(samples: list[Sample]) -> dict:
    """Packed [1, T] micro-batch: input ids, next-token labels (shifted inside each sample), cu_seqlens, images."""
    ids, labels, lengths = [], [], []
    for s in samples:
        ids += s.input_ids
        labels += s.labels[1:] + [-100]  # the label of position t is the token at t+1, within the sample
        lengths.append(len(s.input_ids))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pv = [s.pixel_values for s in samples if s.pixel_values is not None]
    grid = [s.grid_thw for s in samples if s.grid_thw is not None]
    labels_t = torch.tensor([labels])
    return {"input_ids": torch.tensor([ids]), "labels": labels_t, "cu_seqlens": cu,
            "pixel_values": torch.cat(pv) if pv else None, "image_grid_thw": torch.cat(grid) if grid else None,
            "n_tokens": (labels_t != -100).sum(), "n_positions": torch.tensor(len(ids)),
            "n_input": torch.tensor(len(ids))}


class Loader:
    """Micro-batches of this data-parallel rank: an epoch is a shuffled order (seeded per epoch), cut into
    spans of dp × micro-batch samples, rank r taking its slice of each. The tail that does not fill a span is
    left out of the epoch (MindSpeed-MM's drop_last: true, the only setting its BaseRandomBatchSampler has)."""

    def __init__(self, dataset: MLLMDataset, micro_batch: int, dp_rank: int, dp_world: int, seed: int,
                 shuffle: bool):
        self.ds, self.mb, self.rank, self.world = dataset, micro_batch, dp_rank, dp_world
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.pos = 0, 0
        self.n_units = len(dataset)
        if len(dataset) < micro_batch * dp_world:
            raise DataError(f"{len(dataset)} samples are fewer than micro-batch {micro_batch} × data-parallel {dp_world}")

    def _order(self) -> list[int]:
        order = list(range(len(self.ds)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        span = self.mb * self.world
        order = self._order()
        if self.pos + span > len(order):
            self.epoch, self.pos = self.epoch + 1, 0
            order = self._order()
        chunk = order[self.pos: self.pos + span]
        self.pos += span
        mine = chunk[self.rank * self.mb: (self.rank + 1) * self.mb]
        return collate([self.ds.samples[i] for i in mine])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
