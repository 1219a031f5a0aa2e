"""Vision-language samples: canonical records with `images` tokenized as LLaMA-Factory's supervised and
pairwise processors do after its mm plugin has expanded the `<image>` placeholders, cached once (ids and
labels as Megatron indexed datasets, each sample's image paths in images.json), and batched with the
images' model inputs.

Rules: image tokens never carry a label (train_on_prompt included); a cutoff_len that would cut into an
image's tokens is an error naming the record (the model needs every token of an image); packing is
refused by the recipe. Batches are dynamically padded rows (a multiple of 8), in LLaMA-Factory's order
(backends.lf.order); global micro-step k covers units [k·G, (k+1)·G), G = micro × dp, rank r taking its micro of
them (as pairs.PairLoader). For DPO a unit is a pair: the chosen rows, then the rejected rows, both with
the prompt's images.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.common.data.formats import DataFormatError, encode_instruction, encode_pairwise, has_target, \
    iter_records
from backends.common.data.indexed import IndexedDataset, IndexedDatasetWriter
from backends.common.data.templates import IGNORE_INDEX
from backends.lf.mm_plugin import IMAGE_PLACEHOLDER, MediaError, VisionPlugin
from backends.lf.order import num_items
from backends.lf.pairs import UnitLoader, build_once

VL_VERSION = 1


@dataclass
class VLDataset:
    ids: IndexedDataset
    labels: IndexedDataset
    images: list[list[str]]    # per unit (sample, or pair)
    pairwise: bool
    stats: dict

    def __len__(self) -> int:
        return len(self.images)

    def rows(self, unit: int) -> list[tuple[np.ndarray, np.ndarray]]:
        idx = (2 * unit, 2 * unit + 1) if self.pairwise else (unit,)
        return [(np.asarray(self.ids[i], dtype=np.int64), np.asarray(self.labels[i], dtype=np.int64)) for i in idx]

    def summary(self) -> str:
        s = self.stats
        what = "pairs" if self.pairwise else "samples"
        return (f"vision-language dataset {s['folder']} ({'cache hit' if s.get('cached') else 'written'}): "
                f"{s['units']} {what}, {s['images']} images, {s['tokens']} tokens, longest row {s['max_len']}, "
                f"{s['dropped']} without a trained token dropped")


def _expand_record(rec: dict, plugin: VisionPlugin, images: list, where: str) -> dict:
    """The canonical record with each placeholder replaced by its image's tokens, in prompt order."""
    rec = json.loads(json.dumps(rec))
    slots = []  # (container, key) of every prompt-side text, in the order the turns come
    if "messages" in rec:
        slots = [(m, "content") for m in rec["messages"]]
    else:
        slots = [(pair, i) for pair in rec.get("history") or [] for i in (0, 1)]
        slots += [(rec, k) for k in ("instruction", "input") if k in rec]
    expanded = plugin.expand([{"content": c[k]} for c, k in slots], images, where)
    for (c, k), m in zip(slots, expanded):
        c[k] = m["content"]
    return rec


def _key(records: Path, fmt: str, tokenizer, template, plugin: VisionPlugin, cutoff_len: int, max_samples,
         rules: dict, pairwise: bool) -> str:
    import hashlib

    from backends.common.data.preprocess import cache_key

    base = cache_key([records], fmt, tokenizer, template, cutoff_len, max_samples)
    extra = [VL_VERSION, base, plugin.kind, plugin.max_pixels, plugin.min_pixels, plugin.merge_size,
             plugin.image_seq_length, plugin.image_processor.to_json_string(), rules, pairwise]
    return "vl-" + hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()[:24]


def build_vl(records: Path, fmt: str, tokenizer, template, plugin: VisionPlugin, cutoff_len: int, cache: Path, *,
             pairwise: bool = False, max_samples: int | None = None, rules: dict | None = None) -> VLDataset:
    rules = rules or {}
    folder = cache / _key(records, fmt, tokenizer, template, plugin, cutoff_len, max_samples, rules, pairwise)
    cached = build_once(folder, lambda tmp: _write(tmp, records, fmt, tokenizer, template, plugin, cutoff_len,
                                                   pairwise, max_samples, rules))
    meta = json.loads((folder / "meta.json").read_text())
    images = json.loads((folder / "images.json").read_text())
    return VLDataset(IndexedDataset(folder / "ids"), IndexedDataset(folder / "labels"), images, pairwise,
                     {**meta, "folder": str(folder), "cached": cached})


def _write(tmp: Path, records: Path, fmt: str, tokenizer, template, plugin: VisionPlugin, cutoff_len: int,
           pairwise: bool, max_samples, rules: dict) -> None:
    ids_w, labels_w = IndexedDatasetWriter(tmp / "ids"), IndexedDatasetWriter(tmp / "labels")
    all_images, tokens, dropped, longest, n_images = [], 0, 0, 0, 0
    for file, index, rec in iter_records(records):
        if max_samples is not None and len(all_images) + dropped >= max_samples:
            break
        where = rec.pop("source", f"{file} record {index}")
        paths = rec.pop("images", [])
        images = []
        for path in paths:
            try:
                images.append(plugin.open(path))
            except OSError as err:
                raise MediaError(f"{where}: cannot read image {path}: {err}") from None
        rec = _expand_record(rec, plugin, images, where)
        try:
            if pairwise:
                samples = list(encode_pairwise(tokenizer, template, rec, file, index, cutoff_len=cutoff_len))
            else:
                samples = [encode_instruction(tokenizer, template, fmt, rec, file, index, cutoff_len=cutoff_len,
                                              train_on_prompt=rules.get("train_on_prompt", False),
                                              mask_history=rules.get("mask_history", False))]
        except DataFormatError as err:
            raise DataFormatError(f"{where}: {err}") from None
        need = sum(plugin.tokens_per_image(images))
        rows = []
        for sample in samples:
            ids = np.asarray(sample.input_ids, dtype=np.int64)
            got = int((ids == plugin.image_token_id).sum())
            if got != need:
                raise MediaError(f"{where}: cutoff_len {cutoff_len} cuts into its images' tokens ({got} of {need} "
                                 f"kept); raise cutoff_len or lower image_max_pixels")
            labels = np.asarray(sample.labels, dtype=np.int64)
            labels[ids == plugin.image_token_id] = IGNORE_INDEX  # image tokens are never targets
            rows.append((ids, labels))
        if not all(has_target(type(s)(list(i), list(y))) for s, (i, y) in zip(samples, rows)):
            dropped += 1
            continue
        for ids, labels in rows:
            ids_w.add_document(ids)
            labels_w.add_document(labels)
            tokens += len(ids)
            longest = max(longest, len(ids))
        all_images.append(paths)
        n_images += len(paths)
    ids_w.finalize()
    labels_w.finalize()
    if not all_images:
        raise DataFormatError(f"{records}: no record has a trained token within cutoff_len {cutoff_len}")
    (tmp / "images.json").write_text(json.dumps(all_images))
    meta = {"version": VL_VERSION, "units": len(all_images), "images": n_images, "tokens": tokens,
            "dropped": dropped, "max_len": longest, "samples" if not pairwise else "pairs": len(all_images)}
    (tmp / "meta.json").write_text(json.dumps(meta))


class VLLoader(UnitLoader):
    """Micro-batches of `micro_batch` units for this dp rank, with their images' model inputs."""

    def __init__(self, dataset: VLDataset, plugin: VisionPlugin, micro_batch: int, **kw):
        super().__init__(len(dataset), micro_batch, **kw)
        self.dataset, self.plugin = dataset, plugin

    def __next__(self) -> dict:
        import torch

        units = self.next_units()
        per_unit = [self.dataset.rows(u) for u in units]
        n_rows = len(per_unit[0])
        # pairs: every chosen row, then every rejected row (LF's pairwise collator); images follow the rows
        order = [(j, i) for j in range(n_rows) for i in range(len(units))]
        rows = [per_unit[i][j] for j, i in order]
        paths = [p for _, i in order for p in self.dataset.images[units[i]]]
        ids, labels = self.padded(rows)
        input_ids = torch.from_numpy(ids)
        images = [self.plugin.open(p) for p in paths]
        out = {"input_ids": input_ids, "labels": torch.from_numpy(labels),
               "n_tokens": torch.tensor(len(units) if self.dataset.pairwise else num_items(y for _, y in rows)),
               "n_positions": torch.tensor(ids.size), "n_input": torch.tensor(sum(len(x) for x, _ in rows))}
        out.update(self.plugin.batch_inputs(images, input_ids))
        return out


VISION_KEYS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids")
__all__ = ["IMAGE_PLACEHOLDER", "VISION_KEYS", "VLDataset", "VLLoader", "build_vl"]
