"""Vision-language training in backends.lf (Qwen2-VL, Qwen2.5-VL, Gemma3) as LLaMA-Factory 0.9.5 does it:
placeholder expansion against transformers' own processors, the first-step loss against plain transformers,
end-to-end SFT / DPO / LoRA runs on the bundled tiny Qwen2.5-VL, the freeze_* switches, ZeRO-3 at dp 2,
and bad records refused by name."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from backends.common import hf_model
from tests.helpers.lf_runs import ROOT, add_lf, losses, run_lf

sys.path.insert(0, str(ROOT / "examples"))
import make_tiny_vl_model as tiny  # noqa: E402

DATA = ROOT / "examples" / "data"
BUNDLED = ROOT / "examples" / "tiny-qwen2.5-vl"
KINDS = ("qwen2_vl", "qwen2_5_vl", "gemma3")
TEMPLATE = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "gemma3": "gemma3"}
TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
        "system_tag": "system"}
INFO = {"vl_sft": {"file_name": "vl_sft.json", "formatting": "sharegpt", "tags": TAGS,
                   "columns": {"messages": "messages", "images": "images"}},
        "vl_pairs": {"file_name": "vl_pairs.json", "formatting": "sharegpt", "ranking": True, "tags": TAGS,
                     "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected",
                                 "images": "images"}}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlmodels")
    return {k: tiny.build(k, root / k) for k in KINDS}


def vl_file(folder: Path, records: list | None = None, **keys) -> Path:
    """A LLaMA-Factory YAML for the bundled tiny Qwen2.5-VL on the image data (media_dir: examples/data)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dataset_info.json").write_text(json.dumps(INFO))
    for name in ("vl_sft.json", "vl_pairs.json"):
        shutil.copy(DATA / name, folder / name)
    if records is not None:
        (folder / "vl_sft.json").write_text(json.dumps(records))
    tree = {"model_name_or_path": str(BUNDLED), "stage": "sft", "do_train": True, "finetuning_type": "full",
            "dataset": "vl_sft", "dataset_dir": str(folder), "media_dir": str(DATA), "template": "qwen2_vl",
            "cutoff_len": 128, "output_dir": str(folder / "out"), "logging_steps": 1, "save_strategy": "no",
            "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "learning_rate": 0.005,
            "max_steps": 8, "lr_scheduler_type": "constant", "disable_gradient_checkpointing": True,
            "report_to": "none"}
    tree.update(keys)
    path = folder / "train.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _cfg(model: Path, folder: Path, **keys):
    from backends.lf.config import parse_config

    vl_file(folder, **keys)
    tree = yaml.safe_load((folder / "train.yaml").read_text())
    tree["model_name_or_path"] = str(model)
    return parse_config(tree)


# ---------------------------------------------------------------- mm plugin against transformers' processors

def _hf_processor(kind: str, path: Path):
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if kind == "gemma3":
        return AutoProcessor.from_pretrained(path)
    cls = Qwen2VLProcessor if kind == "qwen2_vl" else Qwen2_5_VLProcessor
    check = ProcessorMixin.check_argument_for_proper_class
    # the video processor class needs torchvision; no video is used, so none is given
    ProcessorMixin.check_argument_for_proper_class = lambda self, n, a: None if a is None else check(self, n, a)
    try:
        return cls(image_processor=AutoImageProcessor.from_pretrained(path),
                   tokenizer=AutoTokenizer.from_pretrained(path), video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


@pytest.mark.parametrize("kind", KINDS)
def test_expansion_matches_transformers_processor(models, kind):
    from PIL import Image
    from transformers import AutoTokenizer

    from backends.lf.mm_plugin import load_plugin

    path = models[kind]
    tok = AutoTokenizer.from_pretrained(path)
    plugin = load_plugin(path, tok, 589824, 1024)
    images = [plugin.open(DATA / "images" / "red_square_0.png"), plugin.open(DATA / "images" / "blue_circle_1.png")]
    wide = Image.new("RGB", (90, 30), (10, 200, 30))
    images.append(tiny_regularized(plugin, wide))
    ours = plugin.expand([{"role": "user", "content": "<image>What? <image>and <image>x"}], images, "r")[0]["content"]
    ids = tok(ours, add_special_tokens=False)["input_ids"]
    mark = "<start_of_image>" if kind == "gemma3" else "<|vision_start|><|image_pad|><|vision_end|>"
    ref = _hf_processor(kind, path)(text=[f"{mark}What? {mark}and {mark}x"], images=[images], return_tensors="pt")
    assert ids == ref["input_ids"][0].tolist()
    assert ids.count(plugin.image_token_id) == sum(plugin.tokens_per_image(images)) > len(images)
    ours_in = plugin.batch_inputs(images, torch.tensor([ids]))
    types = "token_type_ids" if kind == "gemma3" else "mm_token_type_ids"
    for key in ("pixel_values", types) + (() if kind == "gemma3" else ("image_grid_thw",)):
        assert torch.equal(ours_in[key], ref[key]), key


def tiny_regularized(plugin, image):
    from backends.lf.mm_plugin import regularize

    return regularize(image, plugin.max_pixels, plugin.min_pixels, plugin.qwen)


def test_regularize_follows_lf():
    from PIL import Image

    from backends.lf.mm_plugin import regularize

    big = regularize(Image.new("L", (200, 100)), 5000, 100, qwen=False)
    assert big.size == (100, 50) and big.mode == "RGB"       # sqrt(5000 / 20000) = 0.5
    small = regularize(Image.new("RGB", (10, 10)), 10 ** 6, 400, qwen=True)
    assert small.size == (28, 28)                            # 20x20 from min_pixels, then Qwen's 28 px floor


# ---------------------------------------------------------------- first-step loss against plain transformers

@pytest.mark.parametrize("kind", KINDS)
def test_first_step_loss_matches_transformers(models, kind, tmp_path):
    from transformers import AutoModelForImageTextToText

    from backends.common.data import load_tokenizer, pad_id
    from backends.lf import model as lfmodel
    from backends.lf.data import build_template, media_dir, read_dataset_info, write_canonical
    from backends.lf.mm_plugin import load_plugin
    from backends.lf.vl_data import VISION_KEYS, VLLoader, build_vl

    cfg = _cfg(models[kind], tmp_path, template=TEMPLATE[kind])
    tok = load_tokenizer(cfg.model_name_or_path)
    plugin = load_plugin(cfg.model_name_or_path, tok, cfg.image_max_pixels, cfg.image_min_pixels)
    records, _ = write_canonical(read_dataset_info(cfg), "sft", tmp_path / "cache", media_dir(cfg))
    # train_on_prompt: the prompt is trained, so only the image-token rule keeps its tokens unlabelled
    ds = build_vl(records, "sharegpt", tok, build_template(cfg, tok), plugin, 128, tmp_path / "cache",
                  rules={"train_on_prompt": True})
    mb = next(VLLoader(ds, plugin, 4, seed=1, pad_id=pad_id(tok)))
    assert "pixel_values" in mb
    ids, labels = mb["input_ids"], mb["labels"]
    plain = torch.full_like(labels, -100)
    plain[:, 1:] = labels[:, :-1]            # unshifted, as transformers' loss takes them
    assert (ids == plugin.image_token_id).sum() > 0
    assert (plain[ids == plugin.image_token_id] == -100).all()
    vision = {k: mb[k] for k in VISION_KEYS if k in mb}

    ref = AutoModelForImageTextToText.from_pretrained(models[kind], dtype=torch.float32)
    want = ref(input_ids=ids, labels=plain, **vision).loss
    hf = lfmodel.load_hf_model(cfg)
    hf_model.apply_kernels(hf)
    loss_sum, count = hf_model.HFCausalLMWithLoss(hf)(ids, labels, **vision)
    assert count == int((labels != -100).sum())
    assert float(loss_sum.detach() / count) == pytest.approx(float(want), abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_pt_on_text_trains_the_language_model_as_transformers(models, kind, tmp_path):
    """Stage pt on a VL model (a text corpus, no images): the engine's first micro-batch loss equals the
    unpatched transformers VL model's on the same tokens."""
    from transformers import AutoModelForImageTextToText

    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command

    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"corpus": {"file_name": str(DATA / "arithmetic_corpus.jsonl"), "columns": {"prompt": "text"}}}))
    tree = {"model_name_or_path": str(models[kind]), "stage": "pt", "do_train": True, "finetuning_type": "full",
            "dataset": "corpus", "dataset_dir": str(tmp_path), "cutoff_len": 64, "max_samples": 8, "packing": False,
            "output_dir": str(tmp_path / "out"), "per_device_train_batch_size": 4, "max_steps": 1,
            "disable_gradient_checkpointing": True, "report_to": "none"}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tree))
    recipe = LFRecipe(parse_command(["train", str(tmp_path / "train.yaml")]))
    recipe.build(init_runtime("cpu"))
    mb = recipe.next_micro_batches()[0]
    keep = mb["labels"] != -100   # already shifted: the target of each position
    # HF's denominator counts each row's first label too, which nothing predicts (tests/lf/test_lf_order.py)
    assert int(mb["n_tokens"]) == int(keep.sum()) + mb["input_ids"].shape[0]
    with torch.no_grad():
        got = float(recipe.loss(recipe.model, mb).sum) / int(keep.sum())
        ref = AutoModelForImageTextToText.from_pretrained(models[kind], dtype=torch.float32).eval()
        logits = ref(input_ids=mb["input_ids"]).logits.float()
    want = float(torch.nn.functional.cross_entropy(logits[keep], mb["labels"][keep]))
    assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("flash_attn,impl", [("auto", "sdpa"), ("sdpa", "sdpa"), ("disabled", "eager"),
                                             ("fa2", "sdpa")])
def test_flash_attn_picks_the_attention_left_to_transformers(models, tmp_path, flash_attn, impl):
    """Gemma3 is not routed through backends.kernels: flash_attn picks transformers' implementation as
    LLaMA-Factory does (fa2 without flash-attn falls back to the default), the same numbers either way."""
    from backends.lf import model as lfmodel

    cfg = _cfg(models["gemma3"], tmp_path, flash_attn=flash_attn)
    hf = lfmodel.load_hf_model(cfg)
    report = hf_model.apply_kernels(hf)
    # its (1 + w) RMSNorms go through backends.kernels, its attention (image tokens see each other) does not
    assert report["attn_implementation"] == impl and set(report["patched"]) == {"rms_norm"}
    assert hf.config.get_text_config()._attn_implementation == impl
    ids = torch.tensor([[5, 17, 42, 9, 33, 8, 21, 2]])
    with torch.no_grad():
        eager = lfmodel.load_hf_model(_cfg(models["gemma3"], tmp_path / "eager", flash_attn="disabled"))
        assert torch.allclose(hf(input_ids=ids).logits, eager(input_ids=ids).logits, atol=1e-5)


# ---------------------------------------------------------------- freeze switches and LoRA targets

def _trained(model, cfg):
    from backends.lf.model import make_trainable

    make_trainable(model, cfg)
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "gemma3"])
def test_freeze_switches_choose_what_trains(models, kind, tmp_path):
    from backends.lf.model import load_hf_model

    vision, projector = ("visual.blocks", "visual.merger") if kind != "gemma3" else ("vision_tower",
                                                                                     "multi_modal_projector")

    def trained(**keys):
        cfg = _cfg(models[kind], tmp_path / str(len(keys)) / "_".join(map(str, keys.values())), **keys)
        return _trained(load_hf_model(cfg), cfg)

    default = trained()  # LF: vision tower and projector frozen, language model trained
    assert not any(vision in n or projector in n for n in default)
    assert any("language_model" in n for n in default)
    both = trained(freeze_vision_tower=False, freeze_multi_modal_projector=False)
    assert any(vision in n for n in both) and any(projector in n for n in both)
    lm_off = trained(freeze_language_model=True, freeze_multi_modal_projector=False)
    assert lm_off and all(projector in n for n in lm_off)
    frozen = trained(finetuning_type="freeze", freeze_trainable_layers=1, freeze_multi_modal_projector=False)
    assert any("language_model.layers.1." in n for n in frozen)
    assert not any("language_model.layers.0." in n for n in frozen)
    assert any(projector in n for n in frozen) and not any(vision in n for n in frozen)


def test_lora_all_targets_leave_the_vision_tower_out(models, tmp_path):
    from backends.lf.model import load_hf_model, make_trainable

    cfg = _cfg(models["qwen2_5_vl"], tmp_path / "a", finetuning_type="lora")
    chosen = make_trainable(load_hf_model(cfg), cfg)
    assert chosen and all("language_model" in n for n in chosen)
    cfg = _cfg(models["qwen2_5_vl"], tmp_path / "b", finetuning_type="lora", freeze_vision_tower=False)
    chosen = make_trainable(load_hf_model(cfg), cfg)
    assert any("visual.blocks" in n for n in chosen)
    assert not any("patch_embed" in n or "merger" in n for n in chosen)  # LF's conflict / projector keys


# ---------------------------------------------------------------- end to end

# SFT loss falling and DPO rewards rising on the bundled model: tests/lf/test_lf_examples.py runs the
# vl-sft / vl-dpo examples through `ascendfactory run` (rendered files included).


ZERO = [("qwen2_5_vl", 3), ("gemma3", 2), ("qwen2_vl", 1)]


@pytest.fixture(scope="module")
def runs(engine_runs, models, tmp_path_factory):
    """The LoRA run and the ZeRO runs (one process, and two under each stage), added at once so that they
    train in one launch per world size (tests/helpers/engine_runs.py): name -> a function giving its
    output dir."""
    tmp = tmp_path_factory.mktemp("lf-vl")
    add_lf(engine_runs, "lf-vl/lora", vl_file(tmp / "lora", finetuning_type="lora", lora_rank=4, max_steps=3))
    names = ["lora"]
    for kind, stage in ZERO:
        ds = tmp / f"ds_z{stage}.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        keys = dict(max_steps=3, per_device_train_batch_size=2, freeze_multi_modal_projector=False,
                    model_name_or_path=str(models[kind]), template=TEMPLATE[kind])
        add_lf(engine_runs, f"lf-vl/{kind}-one", vl_file(tmp / f"{kind}-one", gradient_accumulation_steps=2, **keys))
        add_lf(engine_runs, f"lf-vl/{kind}-two", vl_file(tmp / f"{kind}-two", gradient_accumulation_steps=1,
                                                         deepspeed=str(ds), **keys), nproc=2)
        names += [f"{kind}-one", f"{kind}-two"]
    return {name: (lambda n=name: engine_runs[f"lf-vl/{n}"]) for name in names}


def test_lora_saves_an_adapter_peft_loads(runs):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = runs["lora"]()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] and not any("visual" in t for t in config["target_modules"])
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(BUNDLED), out)
    assert any("lora_A" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("kind,stage", ZERO)
def test_zero_two_processes_match_one(runs, kind, stage):
    """Each VL family under a ZeRO stage (3 and 2: FSDP2 over the language layers, the vision tower and
    projector in the root unit; 1: the distributed optimizer) gives the one-process losses."""
    one, two = losses(runs[f"{kind}-one"]()), losses(runs[f"{kind}-two"]())
    assert len(one) == len(two) == 3
    assert two == pytest.approx(one, abs=1e-5)


# ---------------------------------------------------------------- bad input

def _records():
    return json.loads((DATA / "vl_sft.json").read_text())


@pytest.mark.parametrize("case", ["missing", "count"])
def test_bad_image_records_exit_2_naming_file_and_record(tmp_path, case):
    records = _records()
    if case == "missing":
        records[3]["images"] = ["images/no_such.png"]
    else:
        records[3]["messages"][0]["content"] += " <image>"
    res = run_lf(vl_file(tmp_path, records=records), check=False)
    assert res.returncode == 2, res.stderr[-2000:]
    err = res.stderr
    assert "Traceback" not in err
    assert "vl_sft.json record 3" in err
    assert ("no_such.png" in err) if case == "missing" else ("2 <image> placeholder(s)" in err)


def test_packing_with_images_is_refused(tmp_path):
    res = run_lf(vl_file(tmp_path, packing=True), check=False)
    assert res.returncode == 2 and "packing" in res.stderr and "Traceback" not in res.stderr
