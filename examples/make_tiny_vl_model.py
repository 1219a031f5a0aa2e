"""Tiny random vision-language models in Hugging Face format, made in code (no download), plus the small
image dataset the VL tests and examples train on.

    python examples/make_tiny_vl_model.py        # writes examples/tiny-qwen2.5-vl/, examples/data/images/,
                                                 # examples/data/vl_sft.json and examples/data/vl_pairs.json
    build("gemma3", "/tmp/tiny-gemma3")          # any of KINDS, anywhere
    build("qwen2_5_vl", out, head_dim=32)        # wider text heads (vLLM's CPU attention needs 32 or more)

Each directory loads offline with AutoModelForImageTextToText.from_pretrained and AutoProcessor.from_pretrained
(for Qwen, AutoProcessor also builds a video processor, which needs torchvision; AutoTokenizer and
AutoImageProcessor load without it).
The tokenizer is examples/tiny-qwen3's byte-level BPE (vocab 512) plus each family's special tokens; the image
processors are the PIL ones (no torchvision), with sizes small enough that an image is a handful of tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BASE_TOKENIZER = ROOT / "tiny-qwen3"
KINDS = ("qwen2_vl", "qwen2_5_vl", "gemma3")

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
GEMMA_TOKENS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                "<image_soft_token>", "<end_of_image>"]
QWEN_CHAT = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
             "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
             "{%- for part in message['content'] %}{%- if part['type'] == 'image' %}"
             "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- else %}{{- part['text'] }}{%- endif %}"
             "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
GEMMA_CHAT = ("{{- bos_token }}{%- for message in messages %}"
              "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
              "{{- '<start_of_turn>' + role + '\\n' }}{%- if message['content'] is string %}"
              "{{- message['content'] }}{%- else %}{%- for part in message['content'] %}"
              "{%- if part['type'] == 'image' %}{{- '<start_of_image>' }}{%- else %}{{- part['text'] }}{%- endif %}"
              "{%- endfor %}{%- endif %}{{- '<end_of_turn>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


def _tokenizer(kind: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(BASE_TOKENIZER))
    if kind == "gemma3":
        tok.add_special_tokens({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
        tok.add_special_tokens({"additional_special_tokens": GEMMA_TOKENS}, replace_extra_special_tokens=False)
        tok._set_model_specific_special_tokens({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                    "image_token": "<image_soft_token>"})
        tok.add_bos_token = False  # the chat template writes <bos>; LF's gemma3 template too
        tok.chat_template = GEMMA_CHAT
    else:
        tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS}, replace_extra_special_tokens=False)
        tok._set_model_specific_special_tokens({"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"})
        tok.chat_template = QWEN_CHAT
    return tok


def _vocab(tok) -> int:
    return -(-len(tok) // 64) * 64  # room for every added token, a multiple of 64


def _qwen(kind: str, tok, head_dim: int = 16):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig, \
        Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (the M-RoPE sections), not {head_dim}")
    hidden, unit = 4 * head_dim, head_dim // 16  # 4 heads; the rotary half split t / h / w as 2 : 3 : 3
    text = dict(vocab_size=_vocab(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2 * unit, 3 * unit, 3 * unit]},
                tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                bos_token_id=None)
    common = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                  tie_word_embeddings=False, bos_token_id=None)
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        model_cls, proc_cls = Qwen2VLForConditionalGeneration, "Qwen2VLProcessor"
    else:
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                      fullatt_block_indexes=[1], hidden_act="silu")
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        model_cls, proc_cls = Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLProcessor"
    # 28·28 to 56·56 pixels: an image is 2×2 to 4×4 patches, i.e. 1 to 4 merged image tokens
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    # The processor is saved as its parts (tokenizer with chat template, image processor naming the processor
    # class): building Qwen2VLProcessor itself needs torchvision for its video processor, which is not required.
    images.processor_class = proc_cls
    return config, model_cls, [tok, images]


def _gemma(tok):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_TOKENS}
    text = dict(vocab_size=_vocab(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                sliding_window=32, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
                tie_word_embeddings=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, num_channels=3, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False,
                                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    proc = Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template, image_seq_length=4)
    return config, Gemma3ForConditionalGeneration, [proc]


def build(kind: str, out_dir: str | Path, seed: int = 0, head_dim: int | None = None) -> Path:
    """Write a complete tiny `kind` model (config, random weights, tokenizer, processor) to out_dir.
    head_dim: the text attention's head size of a Qwen kind (default 16; hidden size 4 heads of it)."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(kind)
    if head_dim is not None and kind == "gemma3":
        raise ValueError("head_dim applies to the Qwen kinds")
    config, model_cls, parts = _gemma(tok) if kind == "gemma3" else _qwen(kind, tok, head_dim or 16)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(out)
    for part in parts:
        part.save_pretrained(out)
    return out


# ---------------------------------------------------------------- the image dataset
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 210, 20)}
SHAPES = ("square", "circle")
BACKGROUNDS = ((250, 250, 250), (200, 200, 200))
QUESTIONS = ("What colour is the shape?", "Which colour does the shape in the picture have?")


def write_images(folder: Path) -> list[dict]:
    """One 48 px PNG per colour × shape × background (16), drawn deterministically; their facts."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for colour, rgb in COLOURS.items():
        for shape in SHAPES:
            for b, background in enumerate(BACKGROUNDS):
                img = Image.new("RGB", (48, 48), background)
                draw = ImageDraw.Draw(img)
                box = (10 + 2 * b, 10, 38 + 2 * b, 38)
                (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=rgb)
                name = f"{colour}_{shape}_{b}.png"
                img.save(folder / name, optimize=True)
                out.append({"file": f"images/{name}", "colour": colour, "shape": shape})
    return out


def write_data(data_dir: Path) -> None:
    facts = write_images(data_dir / "images")
    colours = list(COLOURS)
    sft, pairs = [], []
    for q, question in enumerate(QUESTIONS):
        for fact in facts:
            prompt = {"role": "user", "content": f"<image>{question}"}
            sft.append({"messages": [prompt, {"role": "assistant", "content": fact["colour"]}],
                        "images": [fact["file"]]})
            wrong = colours[(colours.index(fact["colour"]) + 1 + q) % len(colours)]
            pairs.append({"messages": [prompt], "chosen": {"role": "assistant", "content": fact["colour"]},
                          "rejected": {"role": "assistant", "content": wrong}, "images": [fact["file"]]})
    (data_dir / "vl_sft.json").write_text(json.dumps(sft, indent=1) + "\n")
    (data_dir / "vl_pairs.json").write_text(json.dumps(pairs, indent=1) + "\n")


def main(argv: list[str]) -> int:
    build("qwen2_5_vl", ROOT / "tiny-qwen2.5-vl")
    write_data(ROOT / "data")
    print(f"wrote {ROOT / 'tiny-qwen2.5-vl'} and {ROOT / 'data'}/vl_sft.json, vl_pairs.json, images/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
