"""MindSpeed-MM's published Qwen2.5-VL fine-tune scripts run on backends.mm (issue 30).

tests/fixtures/upstream/mindspeed-mm/ holds examples/qwen2.5vl/finetune_qwen2_5_vl_3b.sh and _7b.sh with the
model_*.json, data_*.json and tools.json they name, byte for byte (SOURCE.md: commit, paths, sha256). The test
changes only what SOURCE.md lists, on copies and in the argv bash expands from the script: paths (the files, a
tiny Qwen2.5-VL as LOAD_PATH and model_name_or_path, the images), model size (model.json's layers, widths,
heads, vocabulary and its image token ids, sequence length; --vocab-size, --seq-length), process count
(NPUS_PER_NODE) and steps (--train-iters). Every other flag and key runs as published: 3B as dp2 with the
distributed optimizer and the vision tower and projector frozen, 7B as pp2 with model.json's per-stage split
(the vision tower on stage 1), both in one torchrun launch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream" / "mindspeed-mm"
TOKENIZER = ROOT / "examples" / "tiny-qwen2.5-vl"   # its tokenizer and image processor
DATA = ROOT / "examples" / "data"
NPROC, STEPS = 2, 2
SEQ = 128  # --seq-length: the tiny samples are 30-40 tokens (a pipeline pads each micro-batch to it)

# model size: the tiny model every script is shrunk to. The text head stays 128 wide, so model.json's
# mrope_section [16, 24, 24] holds as published.
VOCAB = 576
TEXT = {"num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 512, "num_attention_heads": 2,
        "num_query_groups": 1, "vocab_size": VOCAB, "seq_length": SEQ}
VISION = {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "intermediate_size": 64,
          "num_attention_heads": 2, "fullatt_block_indexes": [1, 3]}   # as published: every group's last block
# pipeline_num_layers per script (vision, text): the published split's shape on the tiny layer counts
SCRIPTS = {"3b": ([4], [2]), "7b": ([4, 0], [1, 1])}


def test_fixtures_are_the_published_files():
    """SOURCE.md's sha256 of every fixture holds: the files stay as published; the test changes copies."""
    rows = r"^\| `([^`]+)` \| `[^`]+`[^|]* \| ([0-9a-f]{64}) \|$"   # | file | upstream path | sha256 |
    listed = dict(re.findall(rows, (FIXTURES / "SOURCE.md").read_text(), re.M))
    files = {p.name for p in FIXTURES.iterdir() if p.name != "SOURCE.md"}
    assert set(listed) == files
    for name, digest in listed.items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name


def shrink_model(tree: dict, pipeline: tuple[list[int], list[int]], image_token: int, vision_start: int) -> dict:
    """model.json at the tiny size: only layer counts, widths, heads, vocabulary (and its token ids)."""
    out = json.loads(json.dumps(tree))
    vision, projector = out["image_encoder"]["vision_encoder"], out["image_encoder"]["vision_projector"]
    vision.update(VISION, pipeline_num_layers=pipeline[0])
    projector.update(input_size=VISION["hidden_size"], hidden_size=TEXT["hidden_size"],
                     ffn_hidden_size=VISION["hidden_size"] * vision["spatial_merge_size"] ** 2)
    out["text_decoder"].update(TEXT, pipeline_num_layers=pipeline[1])
    out.update(img_context_token_id=image_token, vision_start_token_id=vision_start)
    return out


def tiny_hf(out: Path, published: dict) -> Path:
    """A random Qwen2.5-VL in Hugging Face format at the tiny size, every other fact the published model.json's
    (rope theta, M-RoPE sections, norm eps, window, tokens per second, tied or untied output), with the tiny
    tokenizer and image processor."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    ids = dict(zip(("image", "video", "start", "end"), tok.convert_tokens_to_ids(
        ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])))
    t, v = published["text_decoder"], published["image_encoder"]["vision_encoder"]
    tie = not t["untie_embeddings_and_output_weights"]
    text = dict(vocab_size=VOCAB, hidden_size=TEXT["hidden_size"], intermediate_size=TEXT["ffn_hidden_size"],
                num_hidden_layers=TEXT["num_layers"], num_attention_heads=TEXT["num_attention_heads"],
                num_key_value_heads=TEXT["num_query_groups"], rms_norm_eps=t["layernorm_epsilon"],
                max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"],
                                 "mrope_section": t["mrope_section"]},
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    vision = dict(depth=VISION["num_layers"], hidden_size=VISION["hidden_size"],
                  intermediate_size=VISION["intermediate_size"], num_heads=VISION["num_attention_heads"],
                  out_hidden_size=TEXT["hidden_size"], patch_size=v["patch_size"],
                  spatial_merge_size=v["spatial_merge_size"], temporal_patch_size=v["temporal_patch_size"],
                  in_channels=v["in_channels"], window_size=v["window_attn_size"],
                  fullatt_block_indexes=VISION["fullatt_block_indexes"], tokens_per_second=v["tokens_per_second"],
                  hidden_act="silu")
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["image"],
                              video_token_id=ids["video"], vision_start_token_id=ids["start"],
                              vision_end_token_id=ids["end"], tie_word_embeddings=tie, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        shutil.copy(TOKENIZER / name, out / name)
    return out


def expand_script(script: Path, cwd: Path, **values) -> tuple[list[str], list[str]]:
    """The script's torchrun command as bash expands it, with these shell variables' values swapped:
    (torchrun's arguments, pretrain_vlm.py's arguments)."""
    text = script.read_text()
    body = text[text.index("NPUS_PER_NODE="):text.index("chmod 440")]
    for name, value in values.items():
        body, n = re.subn(rf"^{name}=.*$", lambda _: f'{name}="{value}"', body, count=1, flags=re.M)
        assert n == 1, f"{script.name} sets no {name}"
    # torchrun prints what it was given, one argument a line; the rest of the script runs as written
    out = subprocess.run(["bash", "-c", 'torchrun() { printf "%s\\n" "$@"; }\n' + body], cwd=cwd,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    at = out.index("pretrain_vlm.py")
    return out[:at], out[at + 1:]


def swap_flags(argv: list[str], **values) -> list[str]:
    """argv with each --flag's value replaced (the flag given once, as published)."""
    out = list(argv)
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        assert out.count(flag) == 1, f"{flag} appears {out.count(flag)} times"
        out[out.index(flag) + 1] = str(value)
    return out


def world_size(torchrun_args: list[str]) -> int:
    get = {torchrun_args[i]: torchrun_args[i + 1] for i in range(0, len(torchrun_args) - 1, 2)}
    return int(get["--nproc_per_node"]) * int(get["--nnodes"])


@pytest.fixture(scope="module")
def published(engine_runs, tmp_path_factory):
    """name -> (run dir, argv, shrunk model.json); both scripts trained in one torchrun launch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    image_token, vision_start = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>"])
    out = {}
    for size, pipeline in SCRIPTS.items():
        work = tmp_path_factory.mktemp(f"mm-published-{size}")
        tree = json.loads((FIXTURES / f"model_{size}.json").read_text())
        model = shrink_model(tree, pipeline, image_token, vision_start)
        (work / "model.json").write_text(json.dumps(model, indent=4))
        hf = tiny_hf(work / "hf", tree)
        data = json.loads((FIXTURES / f"data_{size}.json").read_text())
        data["dataset_param"]["preprocess_parameters"]["model_name_or_path"] = str(hf)
        data["dataset_param"]["basic_parameters"].update(dataset_dir=str(DATA), dataset=str(DATA / "vl_sft.json"),
                                                         cache_dir=str(work / "cache"))
        (work / "data.json").write_text(json.dumps(data, indent=4))
        shutil.copy(FIXTURES / "tools.json", work / "tools.json")
        torchrun, argv = expand_script(FIXTURES / f"finetune_qwen2_5_vl_{size}.sh", work, NPUS_PER_NODE=NPROC,
                                       MM_DATA=work / "data.json", MM_MODEL=work / "model.json",
                                       MM_TOOL=work / "tools.json", LOAD_PATH=hf, SAVE_PATH=work / "save_dir")
        argv = swap_flags(argv, vocab_size=VOCAB, seq_length=SEQ, train_iters=STEPS)
        engine_runs.add_command(f"mm-published/{size}", "backends.mm", argv, work, world=world_size(torchrun))
        out[size] = (work, argv, model)
    return out


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_sizes(hf: Path) -> dict[str, int]:
    """Each tensor's element count in the HF checkpoint (a tied output stored once, as the model holds it)."""
    from safetensors import safe_open

    with safe_open(hf / "model.safetensors", "pt") as f:
        return {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}


def saved_tensor(step_dir: Path, key: str):
    """One tensor of the engine's checkpoint (torch.distributed.checkpoint), read in this process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata[key]
    out = {key: torch.empty(meta.size, dtype=meta.properties.dtype)}
    with warnings.catch_warnings():  # "no process group: loading in one process", which is meant
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=dcp.FileSystemReader(str(step_dir)))
    return out[key]


@pytest.mark.parametrize("size", list(SCRIPTS))
def test_published_script_trains(published, engine_runs, size):
    """The script trains its steps on its layout, GRAD_ACC_STEP micro-batches a step as published, with
    model.json's freezing and pipeline split, and saves at the end as Megatron does with --save."""
    work, argv, model = published[size]
    run = engine_runs[f"mm-published/{size}"]
    rows = events(run)
    start = next(e for e in rows if e.get("event") == "start")
    steps = [e for e in rows if "loss" in e and "step" in e]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1)) and all(math.isfinite(e["loss"]) for e in steps)
    value = lambda flag: int(argv[argv.index(flag) + 1])  # noqa: E731
    pp = value("--pipeline-model-parallel-size")
    assert start["layout"] == {"dp": NPROC // pp, "tp": 1, "pp": pp, "vpp": 1, "cp": 1, "ep": 1}
    assert start["grad_accum"] == value("--global-batch-size") // (value("--micro-batch-size") * NPROC // pp)
    # the weights came from LOAD_PATH; the frozen vision tower is saved as loaded, the embedding trained
    from safetensors.torch import load_file

    hf, step = load_file(work / "hf" / "model.safetensors"), work / "save_dir" / f"step_{STEPS}"
    assert saved_tensor(step, "model.vl.visual.patch_embed.proj.weight").equal(hf["visual.patch_embed.proj.weight"])
    embed = saved_tensor(step, "model.vl.model.embed_tokens.weight")
    assert 0 < (embed - hf["model.embed_tokens.weight"]).abs().max() < 1e-4   # 2 Adam steps of lr <= 1e-5
    name = f"mm-published/{size}"
    sizes = checkpoint_sizes(work / "hf")
    count = lambda *prefixes: sum(n for k, n in sizes.items() if k.startswith(prefixes))  # noqa: E731
    frozen = count("visual.")     # vision_encoder / vision_projector freeze: true; the text decoder trains
    if pp == 1:
        assert (start["parameters"], start["trainable"]) == (sum(sizes.values()), sum(sizes.values()) - frozen)
    else:  # rank 0's stage holds what pipeline_num_layers puts there: vision [4, 0], the merger, text [1, 1]
        assert model["image_encoder"]["vision_encoder"]["pipeline_num_layers"] == [4, 0]
        assert model["text_decoder"]["pipeline_num_layers"] == [1, 1]
        stage0 = count("model.embed_tokens.", "model.layers.0.")
        assert (start["parameters"], start["trainable"]) == (frozen + stage0, stage0)
        assert "this rank runs vision layers [0, 1, 2, 3], the merger, text layers [0]\n" in engine_runs.log(name, 0)
        assert "this rank runs text layers [1]\n" in engine_runs.log(name, 1)
    # the switches that change nothing here say so, one line each; --mm-tool names the profiler settings file
    log = engine_runs.log(name)
    for flag in ("--mm-tool", "--use-fused-rmsnorm", "--log-tps", "--no-gradient-accumulation-fusion"):
        assert log.count(f"notice: {flag} has no effect") == (flag in argv)


def test_fsdp2_script_is_refused_naming_the_feature(tmp_path):
    """finetune_qwen2_5_vl_72b_fsdp.sh's --use-torch-fsdp2 / --fsdp2-config-path (not copied: it does not run
    here) are refused in one line naming FSDP2 as the missing feature, not as near spellings."""
    from backends.mm.config import ConfigError, parse_args

    _, argv = expand_script(FIXTURES / "finetune_qwen2_5_vl_3b.sh", tmp_path)
    with pytest.raises(ConfigError) as err:
        parse_args(argv + ["--use-torch-fsdp2", "--fsdp2-config-path", "fsdp2_config.yaml"])
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "unsupported MindSpeed-MM flag(s): --use-torch-fsdp2 (MindSpeed-MM's FSDP2 training is not built in "
        "backends.mm")
    assert "--fsdp2-config-path (MindSpeed-MM's FSDP2 training is not built" in message
