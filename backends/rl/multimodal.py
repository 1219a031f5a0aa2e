"""Qwen2.5-VL in the RL engine (VeRL's multimodal GRPO / DAPO / PPO with image prompts).

When the model directory is a Qwen2.5-VL checkpoint (config.json model_type qwen2_5_vl) the actor, the
reference and the critic are backends.mm's native Qwen2.5-VL (VLPolicy below: the same module tree and
checkpoint names, a forward in the RL engine's calling convention), and:

- data: VeRL's RLHFDataset rows: the prompt a chat-message list whose contents hold `<image>` placeholders,
  the images in data.image_key (default `images`: file paths, or VeRL's {"image": path} dicts). Each image
  goes through the model directory's Qwen2-VL image processor (preprocessor_config.json: min / max pixels,
  patches), each `<image>` becomes <|vision_start|><|image_pad|>*N<|vision_end|> (N = merged patches), as
  VeRL's processor call does. A missing image or a placeholder count that differs from the images is one
  error naming the row and the field.
- positions: M-RoPE. A prompt's positions come from its images' grids (transformers' get_rope_index); the
  response continues as text from the prompt's largest position + 1 (the rope delta), in rollout and in
  the log-prob / value passes alike. Image features go only into the prompt's placeholders, so a sampled
  <|image_pad|> in a response is an ordinary token.
- rollout: rollout.generate with `vision=PromptVision(...)`: the packed prefill carries the images and
  their positions, each decode step its row's position. With rl.rollout.engine vllm, vLLM gets what VeRL's
  rollout hands it: the prompt ids with one <|image_pad|> per image (its processor expands them, from the
  same preprocessor_config.json) and the images themselves (Vision.engine_prompts).
- sharding: the vision blocks are FSDP2 units as well as the text layers (sharding.shard).
- the vision tower trains with the rest (VeRL's actor.freeze_vision_tower false) or, with it true, is frozen.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from backends.models import family_of, qwen2_5_vl
from backends.models.qwen2_5_vl import Qwen2_5_VL, VLConfig, save_pretrained
from backends.models.qwen2_5_vl import positions as P

from .config import RLConfig, RLConfigError

PLACEHOLDER = "<image>"
VISION_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"


def is_vl(model_path: str) -> bool:
    return (Path(model_path) / "config.json").is_file() and family_of(model_path) == "qwen2_5_vl"


# ---------------------------------------------------------------------- the model


class VLPolicy(Qwen2_5_VL):
    """Qwen2.5-VL called as the RL engine calls its decoders: forward(input_ids, position_ids, cu_seqlens,
    return_hidden) plus the images (pixel_values, image_grid_thw) and image_mask, the placeholder tokens
    their features go into (the prompt's; None: every image token). position_ids [3,B,S] (or [B,S]: text
    positions on all three rows)."""

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, return_hidden=False, pixel_values=None,
                image_grid_thw=None, image_mask=None):
        embeds = self.model.embed_tokens(input_ids)
        if pixel_values is not None:
            if image_mask is None:
                image_mask = input_ids == self.config.image_token_id
            features = self.visual(pixel_values, image_grid_thw)
            if features.shape[0] != int(image_mask.sum()):
                raise ValueError(f"{features.shape[0]} image features for {int(image_mask.sum())} image tokens")
            embeds = embeds.masked_scatter(image_mask.unsqueeze(-1), features.to(embeds.dtype))
        if position_ids is None:
            position_ids = self.positions(input_ids, image_grid_thw, cu_seqlens=cu_seqlens)
        if position_ids.dim() == 2:
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.to(device=embeds.device, dtype=torch.int32)
        hidden = self.model(embeds, position_ids.to(embeds.device), cu_seqlens)
        if return_hidden:
            return hidden
        return nn.functional.linear(hidden, self.output_weight())

    def vision_blocks(self) -> list[nn.Module]:
        return list(self.visual.blocks)


def from_pretrained(path: str, device="cpu", dtype: torch.dtype = torch.float32) -> VLPolicy:
    return qwen2_5_vl.from_pretrained(path, dtype=dtype, device=device, cls=VLPolicy)


def freeze_vision(model: VLPolicy) -> None:
    """VeRL's actor.freeze_vision_tower: the vision encoder (patch embedding, blocks, merger) takes no updates."""
    model.visual.requires_grad_(False)


class VLCritic(nn.Module):
    """The VL model's hidden states with a scalar value head (the text decoders' Critic, on image prompts)."""

    def __init__(self, lm: VLPolicy):
        super().__init__()
        if hasattr(lm, "lm_head"):
            del lm.lm_head  # unused: FSDP2 needs every trained parameter touched by the backward
        # output_weight() is never read; parts() then names no lm_head
        lm.config = dataclasses.replace(lm.config, text=dataclasses.replace(lm.config.text, tie_word_embeddings=True))
        self.model = lm
        self.value_head = nn.Linear(lm.config.text.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, **vision):
        hidden = self.model(input_ids, position_ids, cu_seqlens, return_hidden=True, **vision)
        return self.value_head(hidden).squeeze(-1).float()

    def vision_blocks(self) -> list[nn.Module]:
        return self.model.vision_blocks()


def export(model: VLPolicy, out_dir: str, model_path: str, rank: int) -> None:
    """The trained VL actor as a transformers directory (whole tensors gathered collectively; rank 0 writes)."""
    tensors = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).cpu()
               for n, p in model.named_parameters()}
    if rank == 0:
        save_pretrained(model, out_dir, tokenizer_dir=model_path, tensors=tensors)


# ---------------------------------------------------------------------- data


def _image_files(value, where: str, key: str) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, dict):  # VeRL's {"image": path} (or {"path": ...})
            item = item.get("image", item.get("path"))
        if not isinstance(item, str):
            raise RLConfigError(f"{where}: {key!r} holds {type(item).__name__}; give image file paths or "
                                "{\"image\": path} entries")
        out.append(item)
    return out


class ImageEncoder:
    """The model directory's Qwen2-VL image processor (its preprocessor_config.json: min / max pixels)."""

    def __init__(self, model_path: str):
        import transformers

        self.proc = transformers.AutoImageProcessor.from_pretrained(model_path)
        self.merge = int(getattr(self.proc, "merge_size", 2))

    def __call__(self, file: Path, where: str):
        from PIL import Image

        try:
            img = Image.open(file).convert("RGB")
        except OSError as err:
            raise RLConfigError(f"{where}: image {file} cannot be read ({err})") from None
        out = self.proc(images=[img], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"][0]


def load_records(cfg: RLConfig, tokenizer, base_dir: Path | None = None) -> list[dict]:
    """cfg.train_files (parquet, or jsonl) -> records with the expanded prompt ids and their images:
    {"prompt_ids", "ground_truth", "data_source", "extra_info", "pixel_values", "image_grid_thw", "images"}
    (images: the image files, for a rollout engine that processes them itself)."""
    from .data import read_rows

    enc = ImageEncoder(cfg.model_path)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    key = cfg.image_key
    records: list[dict] = []
    for file in cfg.train_files:
        path = Path(file)
        if path.suffix == ".jsonl":
            if not path.is_file():
                raise RLConfigError(f"data.train_files: no file {path}")
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            rows = read_rows(path)
        for i, row in enumerate(rows):
            where = f"{file} row {i}"
            messages = row.get(cfg.prompt_key)
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                         for m in messages):
                raise RLConfigError(f"{where}: {cfg.prompt_key!r} must be a list of {{role, content}} chat messages")
            truth = row.get("reward_model", {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) \
                else None
            if truth is None:
                raise RLConfigError(f"{where}: no reward_model.ground_truth (the answer the reward compares to)")
            files = _image_files(row.get(key), where, key)
            marks = sum(str(m["content"]).count(PLACEHOLDER) for m in messages)
            if marks != len(files):
                raise RLConfigError(f"{where}: {marks} {PLACEHOLDER} placeholder(s) in {cfg.prompt_key!r} but "
                                    f"{len(files)} image(s) in {key!r} (data.image_key)")
            pixels, grids, paths = [], [], []
            for name in files:
                f = Path(name)
                if not f.is_absolute() and not f.is_file():
                    f = path.parent / name
                if not f.is_file():
                    raise RLConfigError(f"{where}: {key!r}: image file {name} does not exist")
                pv, grid = enc(f, where)
                pixels.append(pv)
                grids.append(grid)
                paths.append(str(f))
            chat = [{"role": m["role"], "content": str(m["content"]).replace(PLACEHOLDER, VISION_TOKENS)}
                    for m in messages]
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            pieces = text.split("<|image_pad|>")
            counts = [int(g.prod()) // enc.merge ** 2 for g in grids]
            text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if sum(t == image_id for t in ids) != sum(counts):
                raise RLConfigError(f"{where}: the prompt text holds <|image_pad|> tokens of its own")
            if len(ids) > cfg.max_prompt_length:
                if cfg.filter_overlong_prompts:
                    continue
                raise RLConfigError(f"{where}: the prompt has {len(ids)} tokens (images included), more than "
                                    f"data.max_prompt_length {cfg.max_prompt_length} (raise it, or set "
                                    "data.filter_overlong_prompts: true)")
            records.append({"prompt_ids": ids, "ground_truth": truth, "data_source": row.get(cfg.reward_fn_key) or "",
                            "extra_info": row.get("extra_info"),
                            "pixel_values": torch.cat(pixels) if pixels else None,
                            "image_grid_thw": torch.stack(grids) if grids else None, "images": paths})
    if cfg.max_samples is not None and cfg.max_samples > 0:
        records = records[:cfg.max_samples]
    if not records:
        raise RLConfigError("the RL data set has no prompts")
    return records


# ---------------------------------------------------------------------- positions and batches


class Vision:
    """The records' images and M-RoPE prompt positions, for rollout and the forward passes."""

    def __init__(self, cfg: VLConfig, records: list[dict]):
        self.cfg, self.records = cfg, records
        self.image_id, self.merge = cfg.image_token_id, cfg.vision.spatial_merge_size
        self._pos: dict[int, tuple[torch.Tensor, int]] = {}

    def positions(self, index: int) -> tuple[torch.Tensor, int]:
        """(the prompt's positions [3, P], its rope delta: the first response token's position minus P)."""
        if index not in self._pos:
            r = self.records[index]
            ids = torch.tensor([r["prompt_ids"]])
            pos = P.rope_index(ids, r.get("image_grid_thw"), self.image_id, self.merge)[:, 0]
            self._pos[index] = (pos, int(pos.max()) + 1 - ids.shape[1])
        return self._pos[index]

    def _images(self, indices: list[int], device) -> dict:
        pv = [self.records[i]["pixel_values"] for i in indices if self.records[i].get("pixel_values") is not None]
        if not pv:
            return {}
        grids = [self.records[i]["image_grid_thw"] for i in indices
                 if self.records[i].get("image_grid_thw") is not None]
        return {"pixel_values": torch.cat(pv).to(device), "image_grid_thw": torch.cat(grids).to(device)}

    def batch(self, indices: list[int], input_ids: torch.Tensor, prompt_lengths: list[int]) -> dict:
        """A right-padded micro-batch's vision inputs: images, image_mask (the prompts' placeholders) and positions."""
        b, s = input_ids.shape
        pos = torch.empty(3, b, s, dtype=torch.long)
        for row, (index, n) in enumerate(zip(indices, prompt_lengths)):
            prompt, delta = self.positions(index)
            pos[:, row, :n] = prompt
            pos[:, row, n:] = torch.arange(n, s)[None] + delta
        cols = torch.arange(s, device=input_ids.device)[None]
        mask = (input_ids == self.image_id) & (cols < torch.tensor(prompt_lengths, device=input_ids.device)[:, None])
        return {"position_ids": pos.to(input_ids.device), "image_mask": mask,
                **self._images(indices, input_ids.device)}

    def prompts(self, indices: list[int]) -> PromptVision:
        return PromptVision(self, indices)

    def engine_prompts(self, indices: list[int]) -> list[dict]:
        """The records as vLLM prompts: token ids with each image's placeholder run cut to one <|image_pad|>
        (vLLM's processor expands it again; a run left whole would be expanded token by token) and the images."""
        from PIL import Image

        out = []
        for i in indices:
            r = self.records[i]
            ids = [t for k, t in enumerate(r["prompt_ids"])
                   if not (t == self.image_id and k > 0 and r["prompt_ids"][k - 1] == self.image_id)]
            prompt: dict = {"prompt_token_ids": ids}
            if r.get("images"):
                prompt["multi_modal_data"] = {"image": [Image.open(f).convert("RGB") for f in r["images"]]}
            out.append(prompt)
        return out

    def most_images(self) -> int:
        return max((len(r.get("images") or ()) for r in self.records), default=0)


class PromptVision:
    """rollout.generate's hooks for one batch of prompts (the records `indices`)."""

    def __init__(self, vision: Vision, indices: list[int]):
        self.vision, self.indices = vision, indices
        self.deltas = [vision.positions(i)[1] for i in indices]

    def prefill(self, model, ids: torch.Tensor, cu_seqlens: torch.Tensor):
        pos = torch.cat([self.vision.positions(i)[0] for i in self.indices], dim=1)[:, None].to(ids.device)
        images = self.vision._images(self.indices, ids.device)
        mask = ids == self.vision.image_id if images else None
        return model(ids, pos, cu_seqlens, return_hidden=True, image_mask=mask, **images)

    def decode(self, model, ids: torch.Tensor, lengths: torch.Tensor, prompts: list[int]):
        """ids [B,1] at cache columns `lengths`; prompts: each row's prompt (its position in `indices`)."""
        delta = torch.tensor([self.deltas[p] for p in prompts], device=ids.device)
        return model(ids, (lengths + delta)[None, :, None].expand(3, -1, 1), return_hidden=True)
