"""The MindSpeed-LLM flag dialect: what the template renders (flags + engine.yaml), the engine parses."""

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from ascendfactory.job_file import load_job, parse_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render
from backends.llm.config import ConfigError, lora_targets, parse_args, read_engine_file
from tests.helpers.megatron_flags import ARCH

ROOT = Path(__file__).resolve().parents[2]
# the Megatron flag dialect (backend mcore); the FSDP2 YAML is tests/test_mindspeed_llm_fsdp2.py
LLM_EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml"))
                if load_job(p).framework == "mindspeed-llm" and load_job(p).backend == "mcore"]


def _parsed(plan, tmp_path):
    """The engine's config from the rendered flags file and sidecar, as written to the run directory."""
    r = render(plan, tmp_path / "run")
    return parse_args(shlex.split(r.files["mindspeed_llm_args.sh"], comments=True),
                      engine=yaml.safe_load(r.files["engine.yaml"]))


@pytest.mark.parametrize("path", LLM_EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_example_parses(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = make_plan(load_job(path), check_memory=False)
    cfg = _parsed(plan, tmp_path)
    job = plan.job
    assert cfg.parallel.tp == job.parallel.tp and cfg.parallel.pp == job.parallel.pp
    assert cfg.parallel.cp == job.parallel.cp and cfg.parallel.ep == job.parallel.ep
    assert cfg.data.seq_len == job.data.seq_len and cfg.data.packing == job.data.packing
    assert cfg.train.global_batch == job.train.global_batch and cfg.train.lr == job.train.lr
    assert (cfg.lora is not None) == (job.finetuning == "lora")
    assert cfg.train.precision == job.train.precision
    assert cfg.model.model_id == plan.model_id and cfg.model.load_hf == job.model_path
    # (a k8s manifest names the pods' run directory, output_dir, wherever the files are written here)
    run_dir = Path(job.output_dir) if job.launcher == "k8s" else (tmp_path / "run").resolve()
    assert cfg.metrics_file == str(run_dir / "metrics.jsonl")


def test_every_job_setting_reaches_the_engine(job_text, tmp_path):
    job = parse_job(job_text(model="mixtral-8x7b-instruct-v0.1", finetuning="lora",
                             lora={"rank": 4, "alpha": 8, "dropout": 0.1, "targets": ["q_proj", "k_proj", "v_proj"],
                                   "merge_on_export": True},
                             parallel={"moe_dispatcher": "alltoall_seq", "recompute": "selective", "fsdp": True},
                             data={"dynamic_seq_len": True, "pad_to_multiple_of": 16, "max_samples": 10,
                                   "shuffle": False, "template": "qwen3"},
                             train={"steps": 7, "warmup_steps": 2, "export_hf": False, "schedule": "linear",
                                    "min_lr": 1e-6, "weight_decay": 0.01, "grad_clip": 0.5, "precision": "bf16",
                                    "seed": 3, "moe_aux_loss_coeff": 0.01, "save_interval": 3},
                             kernels={"backend": "reference", "overrides": {"attention": "reference"}}))
    cfg = _parsed(make_plan(job, check_memory=False), tmp_path)
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 8 and cfg.lora.targets == ["linear_qkv"]
    assert cfg.lora.dropout == 0.1 and cfg.lora.merge_on_export and cfg.parallel.moe_dispatcher == "alltoall_seq"
    assert cfg.export_hf is None and cfg.model.model_id == "mixtral-8x7b-instruct-v0.1"
    assert cfg.parallel.recompute == "selective" and cfg.parallel.fsdp
    assert cfg.data.dynamic and cfg.data.pad_to_multiple_of == 16 and cfg.data.max_samples == 10
    assert not cfg.data.shuffle and cfg.data.template == "qwen3"
    t = cfg.train
    assert (t.steps, t.warmup, t.schedule, t.min_lr, t.weight_decay, t.grad_clip, t.precision, t.seed) == \
        (7, 2, "linear", 1e-6, 0.01, 0.5, "bf16", 3)
    assert t.moe_aux_loss_coeff == 0.01 and t.save_interval == 3
    assert cfg.kernel_backend == "reference" and cfg.kernel_overrides == {"attention": "reference"}
    assert cfg.model.overrides["moe"]["num_experts"] == 8 and cfg.model.overrides["moe"]["experts_per_token"] == 2


BASE = [*ARCH, "--data-path", "x", "--seq-length", "8", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters",
        "1"]
CARD = {"model_id": "qwen3-8b"}


def test_unknown_flag_names_the_closest_and_lists_the_supported():
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + ["--tensor-parallel-size", "2"], engine=CARD)
    assert "did you mean --tensor-model-parallel-size" in str(err.value) and "--seq-length" in str(err.value)
    with pytest.raises(ConfigError, match="give --train-iters, or train_epochs in engine.yaml"):
        parse_args(BASE[:-2], engine=CARD)
    assert parse_args(BASE[:-2], engine={**CARD, "train_epochs": 2}).train.epochs == 2.0
    with pytest.raises(ConfigError, match="load_hf .* or model_id"):
        parse_args(BASE, engine={})
    # what AscendFactory alone needs is no flag: the engine refuses it on the command line
    with pytest.raises(ConfigError, match="--metrics-file \\(not a MindSpeed-LLM flag: engine.yaml's metrics_file"):
        parse_args(BASE + ["--metrics-file", "m.jsonl"], engine=CARD)


def test_upstream_types_and_current_names():
    cfg = parse_args(BASE + ["--rotary-base", "1000000", "--lora-r", "8", "--lora-alpha", "16",
                             "--lora-target-modules", "linear_qkv",
                             "--attention-mask-type", "causal", "--multi-latent-attention", "--pack",
                             "--prompt-type", "deepseek3"], engine=CARD)
    assert cfg.model.overrides["rope_theta"] == 1e6 and isinstance(cfg.model.overrides["rope_theta"], float)
    assert cfg.lora.alpha == 16.0 and cfg.data.packing and cfg.data.template == "deepseek"
    with pytest.raises(ConfigError, match="invalid int value: '1000000.0'"):
        parse_args(BASE + ["--rotary-base", "1000000.0"], engine=CARD)
    # the old spellings MindSpeed-LLM still takes (deprecated_args.py) are taken too
    parse_args(BASE + ["--cp-attention-mask-type", "causal", "--multi-head-latent-attention"], engine=CARD)


def test_sidecar_is_read_from_af_engine_file_and_checked(tmp_path, monkeypatch):
    side = tmp_path / "engine.yaml"
    side.write_text("model_id: qwen3-8b\nkernels: {backend: reference, overrides: {attention: cuda}}\n"
                    "metrics_file: m.jsonl\nexport_hf: hf\nlora: {dropout: 0.05, merge_on_export: true}\n")
    monkeypatch.setenv("AF_ENGINE_FILE", str(side))
    cfg = parse_args(BASE + ["--lora-r", "4", "--lora-target-modules", "all"])
    assert (cfg.model.model_id, cfg.kernel_backend, cfg.kernel_overrides) == ("qwen3-8b", "reference",
                                                                              {"attention": "cuda"})
    assert (cfg.metrics_file, cfg.export_hf, cfg.lora.dropout, cfg.lora.merge_on_export) == \
        ("m.jsonl", "hf", 0.05, True)
    for text, said in [("model_id: x\nmetric_file: m\n", r"unknown setting\(s\) metric_file"),
                       ("model_id: x\nkernels: {backend: gpu}\n", "kernels.backend must be one of"),
                       ("model_id: x\nlora: {dropout: 1.5}\n", "lora.dropout must be a number in"),
                       ("model_id: x\ntrain_epochs: -1\n", "train_epochs must be a positive number"),
                       ("[1, 2]\n", "expected a mapping")]:
        side.write_text(text)
        with pytest.raises(ConfigError, match=said) as err:
            read_engine_file()
        assert str(side) in str(err.value)
    monkeypatch.setenv("AF_ENGINE_FILE", str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="missing.yaml .*cannot read it"):
        read_engine_file()


def test_mindspeed_lora_names_map_to_the_decoders_linears():
    dense = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
             "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
             "model.layers.0.mlp.down_proj"]
    assert lora_targets(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dense) == \
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    mla = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa",
           "model.layers.0.self_attn.kv_b_proj", "model.layers.0.mlp.gate_up_proj"]
    assert lora_targets(["linear_qkv", "linear_qb", "linear_kvb", "linear_fc1"], mla) == \
        ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_up_proj"]
    assert lora_targets(["all"], dense) == ["all"] and lora_targets(["q_proj"], dense) == ["q_proj"]
    with pytest.raises(ConfigError, match="none of them"):
        lora_targets(["linear_qb"], dense)


def test_recompute_method_and_num_layers_are_honoured_or_refused():
    """--recompute-method / --recompute-num-layers reach the model (Megatron's uniform / block), and
    with selective granularity they are refused instead of ignored."""
    from backends.common.parallel.data_parallel import single_process
    from backends.common.parallel.recompute import Recomputed
    from backends.llm import parallelize
    from backends.models import decoder as models
    from tests.helpers.tiny_hf import _COMMON, TINY

    cfg = models.ModelConfig.from_hf({"model_type": "qwen3", **_COMMON, **TINY["qwen3"][2], "num_hidden_layers": 4})

    def checkpointed(flags):
        decoder = models.build_model(cfg)
        p = parse_args(BASE + flags, engine=CARD).parallel
        parallelize._recompute(decoder, p, single_process(None))
        return [isinstance(layer.__dict__.get("forward"), Recomputed) for layer in decoder.model.layers]

    assert checkpointed(["--recompute-granularity", "full", "--recompute-method", "block",
                         "--recompute-num-layers", "3"]) == [True, True, True, False]
    assert checkpointed(["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "2"]) == [True, False, True, False]
    with pytest.raises(ConfigError, match="--recompute-granularity full only"):
        checkpointed(["--recompute-granularity", "selective", "--recompute-method", "block"])


# one argument list per refusal of backends.llm.config.refusals: each message opens with that flag
REFUSALS = {
    "--hidden-dropout": ["--hidden-dropout", "0.1"], "--attention-dropout": ["--attention-dropout", "0.1"],
    "--stage": ["--stage", "dpo"], "--ckpt-format": ["--ckpt-format", "zarr"],
    "--dataloader-type": ["--dataloader-type", "external"],
    "--moe-router-load-balancing-type": ["--moe-router-load-balancing-type", "sinkhorn"],
    "--seq-aux": ["--seq-aux", "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01"],
    "--moe-router-group-topk": ["--moe-router-topk", "6", "--moe-router-num-groups", "8",
                                "--moe-router-group-topk", "3"],
    "--rope-scaling-type": ["--rope-scaling-type", "plm"],
    "--model-type-hf": ["--model-type-hf", "bloom"], "--enable-hf2mg-convert": ["--enable-hf2mg-convert"],
    "--lr-warmup-fraction": ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
    "--initial-loss-scale": ["--initial-loss-scale", "65536", "--fp16"],
    "--moe-layer-freq": ["--moe-layer-freq", "[0]*1+[1]*26"],
    "--full-shuffle-instruction-dataset": ["--full-shuffle-instruction-dataset", "--is-instruction-dataset"],
}


@pytest.mark.parametrize("flag", sorted(REFUSALS))
def test_every_refusal_names_its_flag_and_what_to_do(flag):
    from tests.llm.test_published_scripts import refused_flags

    with pytest.raises(ConfigError) as err:
        parse_args(BASE + REFUSALS[flag], engine=CARD)
    assert refused_flags(str(err.value)) == [flag]
    assert any(word in str(err.value) for word in ("use ", "set ", "give", "drop", "leave", "let "))


PREPROCESS = ["--input", "x.json", "--tokenizer-name-or-path", "tok", "--output-prefix", "out/p"]
PREPROCESS_REFUSALS = {
    "--handler-name": ["--handler-name", "AlpacaStylePairwiseHandler"],
    "--prompt-type": ["--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "chatglm3"],
    "--tokenizer-type": ["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file": ["--vocab-file", "v.txt"],
    "--streaming": ["--streaming"], "--map-keys": ["--map-keys", '{"prompt": "q"}'],
    "--mix-strategy": ["--mix-strategy", "interleave_under"], "--dataset-impl": ["--dataset-impl", "lazy"],
    "--pad-to-multiple-of": ["--pad-to-multiple-of", "8"], "--drop-thinking": ["--drop-thinking", "false"],
    "--pack": ["--pack", "--seq-length", "64"], "--neat-pack": ["--handler-name", "AlpacaStyleInstructionHandler",
                                                                "--prompt-type", "qwen", "--neat-pack"],
}


@pytest.mark.parametrize("flag", sorted(PREPROCESS_REFUSALS))
def test_every_preprocess_refusal_names_its_flag(flag):
    from backends.llm import preprocess

    ns = preprocess.upstream_parser().parse_args(PREPROCESS + PREPROCESS_REFUSALS[flag])
    assert [r.split(" ", 1)[0].rstrip(":") for r in preprocess.refusals(ns)] == [flag]


def test_moe_fusions_are_kernel_choices_and_neat_pack_packs():
    from backends.llm.recipe import kernel_overrides

    plain = kernel_overrides(parse_args(BASE, engine=CARD))
    assert plain["grouped_mm"] == plain["moe_permute"] == plain["moe_unpermute"] == "reference"
    fused = kernel_overrides(parse_args(BASE + ["--moe-grouped-gemm", "--moe-permute-fusion"], engine=CARD))
    assert not {"grouped_mm", "moe_permute", "moe_unpermute"} & set(fused)
    assert kernel_overrides(parse_args(BASE + ["--moe-grouped-gemm"], engine={**CARD, "kernels": {
        "overrides": {"grouped_mm": "reference"}}}))["grouped_mm"] == "reference"   # engine.yaml wins
    assert parse_args(BASE + ["--neat-pack"], engine=CARD).data.packing
    assert parse_args(BASE + ["--no-pad-to-seq-lengths"], engine=CARD).data.dynamic
    assert not parse_args(BASE + ["--sequence-parallel"], engine=CARD).parallel.sp       # tp 1: Megatron drops it
    assert not hasattr(parse_args(BASE, engine=CARD), "extra")


def test_partial_loads_of_an_engine_checkpoint_are_refused(tmp_path):
    from backends.common.checkpoint.resume import MARKER
    from backends.llm.recipe import resume_setting

    (tmp_path / "step_2").mkdir()
    (tmp_path / "step_2" / MARKER).write_text("{}")
    for flag in ("--finetune", "--no-load-optim", "--no-load-rng"):
        with pytest.raises(ConfigError, match=f"^{flag} with --load"):
            resume_setting(parse_args(BASE + ["--load", str(tmp_path), flag], engine=CARD))
    empty = tmp_path / "none"
    assert resume_setting(parse_args(BASE + ["--load", str(empty), "--finetune"], engine=CARD)) is None
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint"):
        resume_setting(parse_args(BASE + ["--load", str(empty), "--exit-on-missing-checkpoint"], engine=CARD))


def test_load_reads_its_own_folder_as_megatron_does(tmp_path):
    """--load is where the checkpoint comes from, whatever --save says: the root that is --save too resumes
    "auto" (the trainer's newest intact one there), another root its newest complete checkpoint, a root
    without one starts afresh (backends.common.kit.megatron_resume; tests/mm/test_mm_dialect.py: the MM engine's)."""
    from backends.common.checkpoint.resume import MARKER
    from backends.llm.recipe import resume_setting

    for step in (2, 4):
        (tmp_path / "old" / f"step_{step}").mkdir(parents=True)
        for name in (MARKER, ".metadata", "rank_0.pt"):  # what resolve_resume looks for in a complete one
            (tmp_path / "old" / f"step_{step}" / name).write_text("{}")
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    assert resume_setting(parse_args(BASE + ["--load", old, "--save", old], engine=CARD)) == "auto"
    assert resume_setting(parse_args(BASE + ["--load", old, "--save", new], engine=CARD)) == str(
        tmp_path / "old" / "step_4")
    assert resume_setting(parse_args(BASE + ["--load", new, "--save", new], engine=CARD)) == "auto"
    assert resume_setting(parse_args(BASE + ["--load", new, "--save", old], engine=CARD)) is None
    assert resume_setting(parse_args(BASE + ["--load", f"{old}/step_2", "--save", new], engine=CARD)) == str(
        tmp_path / "old" / "step_2")


def test_hf2mg_load_checks_the_model_type_and_architecture_flags(tiny_model):
    from backends.llm.recipe import build_decoder

    hf = str(tiny_model("qwen3"))
    load = BASE + ["--load", hf, "--enable-hf2mg-convert", "--model-type-hf", "qwen3"]
    cfg = parse_args(load + ["--norm-epsilon", "1e-6"], engine={})
    assert cfg.model.load_hf == hf and cfg.load is None
    assert build_decoder(cfg).config.family == "qwen3"
    with pytest.raises(ConfigError, match=r"--norm-epsilon 1e-05 \(the model has rms_norm_eps=1e-06\)"):
        build_decoder(parse_args(load + ["--norm-epsilon", "1e-5"], engine={}))
    with pytest.raises(ConfigError, match="--model-type-hf llama2: .* holds a qwen3 model"):
        build_decoder(parse_args(BASE + ["--load", hf, "--enable-hf2mg-convert", "--model-type-hf", "llama2"],
                                 engine={}))
    with pytest.raises(ConfigError, match=r"^--rotary-base 1000000\.0: config.json .* rope_theta=10000\.0"):
        build_decoder(parse_args(load + ["--rotary-base", "1000000"], engine={}))


def test_lr_warmup_fraction_is_of_the_decay_steps():
    from backends.common.optim import lr_at

    cfg = parse_args(BASE[:-1] + ["100", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "50"], engine=CARD)
    assert (cfg.train.warmup_fraction, cfg.train.decay_steps) == (0.1, 50)
    assert lr_at(5, lr=1.0, min_lr=0.0, warmup=5.0, total=50, style="cosine") == 1.0  # what the recipe builds
    assert lr_at(4, lr=1.0, min_lr=0.0, warmup=5.0, total=50, style="cosine") == 0.8


def test_prompt_types_encode_as_mindspeed_llm():
    """--prompt-type qwen keeps MindSpeed-LLM's default system (the named `qwen` follows LLaMA-Factory's);
    --enable-thinking is the qwen3 reasoning switch."""
    from backends.common.data import resolve_template
    from backends.llm.config import prompt_template
    from tests.helpers.tiny_tokenizers import family_tokenizer

    tok = family_tokenizer("qwen3")
    assert prompt_template("qwen", tok, None).default_system == "You are a helpful assistant."
    assert resolve_template("qwen", tok).default_system.startswith("You are Qwen, created by Alibaba Cloud.")
    for thinking in (None, True, False):
        assert prompt_template("qwen3", tok, thinking).enable_thinking is thinking
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert prompt_template("qwen3", tok, None).render(conv) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n")


LLAMA3_FLAGS = ["--rope-scaling-type", "llama3", "--rope-scaling-factor", "8.0", "--low-freq-factor", "1.0",
                "--high-freq-factor", "4.0", "--original-max-position-embeddings", "8192"]  # Llama 3.1's scripts


def _hf_dir(tmp_path, config) -> str:
    """A model directory with only config.json: enough for build_decoder (the meta model, no weights)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(tmp_path / "config.json"))
    return str(tmp_path)


def _tiny_llama(**rope):
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, num_hidden_layers=2, vocab_size=256, max_position_embeddings=16384,
                                    rope_parameters={"rope_theta": 10000.0, **rope})


def test_llama3_rope_flags_are_the_models_rope_as_transformers_computes_it(tmp_path):
    """Llama 3.1's rope flags on a model whose config.json has the same llama3 scaling: the engine's rotary
    tables equal transformers' LlamaRotaryEmbedding for a config built from the flags' values (each flag
    mapped to its rope_parameters key); a flag the model contradicts, one left out, or a model without the
    scaling is refused by name (MindSpeed-LLM would build the flags' rope onto the checkpoint)."""
    from transformers.models.llama import modeling_llama

    from backends.llm.recipe import build_decoder

    values = dict(zip(LLAMA3_FLAGS[0::2], LLAMA3_FLAGS[1::2]))
    said = _tiny_llama(rope_type="llama3", factor=float(values["--rope-scaling-factor"]),
                       low_freq_factor=float(values["--low-freq-factor"]),
                       high_freq_factor=float(values["--high-freq-factor"]),
                       original_max_position_embeddings=float(values["--original-max-position-embeddings"]))
    model_dir = _hf_dir(tmp_path / "llama31", _tiny_llama(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=8192))
    decoder = build_decoder(parse_args(BASE + LLAMA3_FLAGS, engine={"load_hf": model_dir}))
    pos = torch.tensor([[0, 1, 7, 100, 2047, 8191, 16000]])
    cos, sin = decoder.model.rotary(pos, torch.float32)
    want_cos, want_sin = modeling_llama.LlamaRotaryEmbedding(said)(torch.zeros(1), pos)
    torch.testing.assert_close(cos, want_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=1e-6, atol=1e-6)
    # the tiny head still has all three bands: kept (short wavelengths), divided by the factor, blended
    plain = modeling_llama.LlamaRotaryEmbedding(_tiny_llama(rope_type="default")).inv_freq
    ratio = (modeling_llama.LlamaRotaryEmbedding(said).inv_freq / plain).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 8) and any(1 / 8 < r < 1 for r in ratio)

    for flag, other in (("--rope-scaling-factor", "16.0"), ("--low-freq-factor", "2.0"), ("--high-freq-factor", "2.0"),
                        ("--original-max-position-embeddings", "4096.0")):
        argv = list(LLAMA3_FLAGS)
        argv[argv.index(flag) + 1] = other
        with pytest.raises(ConfigError, match=f"is not the model these flags describe: {flag} {other} "):
            build_decoder(parse_args(BASE + argv, engine={"load_hf": model_dir}))
    plain_dir = _hf_dir(tmp_path / "plain", _tiny_llama(rope_type="default"))
    with pytest.raises(ConfigError, match="--rope-scaling-type llama3 \\(the model has rope_scaling.rope_type=None"):
        build_decoder(parse_args(BASE + LLAMA3_FLAGS, engine={"load_hf": plain_dir}))
    with pytest.raises(ConfigError, match="--rope-scaling-type llama3: give --high-freq-factor, "
                                          "--original-max-position-embeddings too"):
        parse_args(BASE + LLAMA3_FLAGS[:6], engine={"load_hf": model_dir})
    with pytest.raises(ConfigError, match="--rope-scaling-type longrope: this rotary scaling is not built"):
        parse_args(BASE + ["--rope-scaling-type", "longrope"], engine={"load_hf": model_dir})
    # the model cards are held to the same flags: Llama 3.1's match, Llama 3.2's factor is 32
    build_decoder(parse_args(BASE + LLAMA3_FLAGS, engine={"model_id": "llama3.1-8b"}))
    with pytest.raises(ConfigError, match="--rope-scaling-factor 8.0 \\(the model has rope_scaling.factor=32.0"):
        build_decoder(parse_args(BASE + LLAMA3_FLAGS, engine={"model_id": "llama3.2-1b"}))


def test_glm_rope_flags_are_glms_interleaved_half_rotary(tmp_path):
    """GLM-4's --use-glm-rope --rotary-percent 0.5: the first half of each head rotated by adjacent pairs, which is
    MindSpeed-LLM's _process_partial_rope and transformers' Glm apply_rotary_pos_emb; the engine's GLM attention
    rotates q as transformers does for a GlmConfig with partial_rotary_factor = --rotary-percent. Megatron's
    partial rope without --use-glm-rope (halves, not pairs) and other fractions are refused for this model."""
    import transformers
    from transformers.models.glm import modeling_glm

    from backends.llm.recipe import build_decoder

    def glm(partial):
        return transformers.GlmConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, num_hidden_layers=1, vocab_size=256,
                                      attention_bias=True, partial_rotary_factor=partial)

    flags = ["--use-glm-rope", "--rotary-percent", "0.5"]
    model_dir = _hf_dir(tmp_path / "glm", glm(0.5))
    decoder = build_decoder(parse_args(BASE + flags, engine={"load_hf": model_dir}))
    attn = decoder.model.layers[0].self_attn
    torch.manual_seed(0)
    q, pos = torch.randn(1, 5, 2, 32), torch.arange(5)[None]
    cos, sin = decoder.model.rotary(pos, torch.float32)
    got = kernels_apply_rotary(q, cos, sin, attn)
    said = glm(float(flags[2]))
    want_cos, want_sin = modeling_glm.GlmRotaryEmbedding(said)(q, pos)
    want, _ = modeling_glm.apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), want_cos, want_sin)
    torch.testing.assert_close(got, want.transpose(1, 2))
    assert not torch.equal(got[..., :16], q[..., :16]) and torch.equal(got[..., 16:], q[..., 16:])
    for argv, wrong in ((["--rotary-percent", "0.5"], "--use-glm-rope False"),
                        (["--use-glm-rope"], "--rotary-percent 1.0"),
                        (["--use-glm-rope", "--rotary-percent", "0.25"], "--rotary-percent 0.25")):
        with pytest.raises(ConfigError, match=f"flags describe: .*{wrong} \\(the model has"):
            build_decoder(parse_args(BASE + argv, engine={"load_hf": model_dir}))
    with pytest.raises(ConfigError, match="--use-glm-rope True \\(the model has rotary_interleaved=False"):
        build_decoder(parse_args(BASE + flags[:1] + ["--rotary-percent", "1.0"],
                                 engine={"load_hf": _hf_dir(tmp_path / "llama", _tiny_llama(rope_type="default"))}))
    build_decoder(parse_args(BASE + flags, engine={"model_id": "glm-4-9b-chat"}))


def kernels_apply_rotary(q, cos, sin, attn):
    from backends import kernels

    return kernels.apply_rotary(q, cos, sin, interleaved=attn.interleaved, rotary_dim=attn.rotary_dim)


def _moe_dir(tmp_path, family, **changes):
    """config.json of a tiny MoE model of `family` (tests/helpers/tiny_hf's shapes), no weights."""
    import transformers

    from tests.helpers.tiny_hf import _COMMON, TINY

    cls, _, extra = TINY[family]
    return _hf_dir(tmp_path / f"{family}-{len(changes)}", getattr(transformers, cls)(**{**_COMMON, **extra, **changes}))


def _megatron_route(logits, topk, pre_softmax, num_groups=None, group_topk=None):
    """Megatron core_v0.12.1's topk_softmax_with_capacity (softmax scores, no capacity) as a dense [T, E] gate:
    group-limited routing keeps the group_topk groups with the best sum of their top-(topk // group_topk) scores."""
    def topk_of(scores):
        if not group_topk:
            return torch.topk(scores, k=topk, dim=1)
        t, e = scores.shape
        group_scores = scores.view(t, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter(1, torch.topk(group_scores, k=group_topk, dim=-1)[1], 1)
        keep = keep.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, -1).bool()
        return torch.topk(scores.masked_fill(~keep, float("-inf")), k=topk, dim=-1)

    if pre_softmax:
        probs, ids = topk_of(torch.softmax(logits, dim=-1))
    else:
        top, ids = topk_of(logits)
        probs = torch.softmax(top, dim=-1)
    return torch.zeros_like(logits).scatter(1, ids, probs)


def _engine_route(decoder_config, logits):
    from backends.models.decoder.moe import MoE

    weights, ids, _ = MoE(decoder_config).route(logits)
    return torch.zeros_like(logits).scatter(1, ids, weights)


def test_router_flags_are_megatrons_routing_of_the_model(tmp_path, capsys, monkeypatch):
    """--moe-router-pre-softmax (top-k of the softmax, unnormalised), Megatron's default (softmax over the top-k
    logits), its group-limited routing and MindSpeed-LLM's pai_megatron_aux_loss routing are each the model's
    own routing where the flags are accepted (the gates equal Megatron's formula on the same logits), and
    refused by name where the model routes otherwise."""
    from backends.llm.recipe import build_decoder

    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    v2 = _moe_dir(tmp_path, "deepseek_v2", norm_topk_prob=False)          # DeepSeek-V2-Lite: greedy, unnormalised
    v2_groups = _moe_dir(tmp_path, "deepseek_v2", norm_topk_prob=False, topk_method="group_limited_greedy",
                         n_group=4, topk_group=2, num_experts_per_tok=3)
    qwen3_moe = _moe_dir(tmp_path, "qwen3_moe", num_experts=8)              # renormalised top-k
    def route(model_dir, flags, k="2"):
        argv = BASE + ["--moe-router-topk", k] + flags
        return _engine_route(build_decoder(parse_args(argv, engine={"load_hf": model_dir})).config, logits)

    torch.testing.assert_close(route(v2, ["--moe-router-pre-softmax"]), _megatron_route(logits, 2, True))
    torch.testing.assert_close(route(qwen3_moe, []), _megatron_route(logits, 2, False))
    route(qwen3_moe, ["--moe-router-pre-softmax", "--norm-topk-prob"])    # MindSpeed-LLM renormalises them
    with pytest.raises(ConfigError, match="--moe-router-pre-softmax: top-k renormalised False \\(the model has "
                                          "moe.norm_topk_prob=True"):
        route(qwen3_moe, ["--moe-router-pre-softmax"])
    groups = ["--moe-router-num-groups", "4", "--moe-router-group-topk", "2"]
    torch.testing.assert_close(route(v2_groups, ["--moe-router-pre-softmax", *groups], k="3"),
                               _megatron_route(logits, 3, True, 4, 2))
    assert not torch.equal(_megatron_route(logits, 3, True, 4, 2), _megatron_route(logits, 3, True))  # groups bite

    # DeepSeek-V2-Lite's published scripts: pai routing, group flags and --seq-aux that it does not read
    pai = ["--moe-router-load-balancing-type", "pai_megatron_aux_loss", "--moe-router-num-groups", "8",
           "--moe-router-group-topk", "1", "--seq-aux", "--moe-aux-loss-coeff", "0.01"]
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()
    torch.testing.assert_close(route(v2, pai), _megatron_route(logits, 2, True))
    noticed = [line.split(": notice: ")[1].split()[0] for line in capsys.readouterr().err.splitlines()]
    assert noticed == ["--moe-router-num-groups", "--moe-router-group-topk", "--seq-aux", "--split"]  # + the data's
    for model_dir, fact in ((qwen3_moe, "top-k renormalised False \\(the model has moe.norm_topk_prob=True"),
                            (v2_groups, "expert groups greedy \\(the model has "
                                        "moe.topk_method='group_limited_greedy'")):
        with pytest.raises(ConfigError, match=f"--moe-router-load-balancing-type pai_megatron_aux_loss: {fact}"):
            route(model_dir, pai, k="3" if model_dir == v2_groups else "2")


def test_moe_aux_loss_coeff_weighs_megatrons_switch_loss(tmp_path):
    """--moe-aux-loss-coeff multiplies Megatron core_v0.12.1's switch_load_balancing_loss_func, summed over the MoE
    layers (each router applies its own): sum(probs.sum(0) * tokens_per_expert) * E / (T * T * topk), from each
    router's logits, as Megatron computes it."""
    from backends.llm.recipe import CausalLMWithLoss, causal_lm_loss
    from backends.models import decoder as models
    from backends.models.decoder.moe import MoE

    model_dir = Path(_moe_dir(tmp_path, "qwen3_moe", num_experts=8, num_experts_per_tok=3))
    cfg = models.ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    torch.manual_seed(0)
    model = CausalLMWithLoss(models.build_model(cfg))
    logits = []
    for m in model.modules():
        if isinstance(m, MoE):
            m.gate.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    loss = causal_lm_loss(model, {"input_ids": ids, "labels": ids}, aux_coeff=0.1, topk=3, cp=None)
    want = 0.0
    for layer in logits:
        probs = torch.softmax(layer, dim=-1)
        chosen = torch.topk(layer, k=3, dim=1)[1].reshape(-1)
        tokens_per_expert = torch.zeros(8).scatter_add(0, chosen, torch.ones(24 * 3))
        want += torch.sum(probs.sum(dim=0) * tokens_per_expert) * 8 / (24 * 24 * 3)
    assert len(logits) == cfg.num_layers
    torch.testing.assert_close(loss.extra, 0.1 * want)
    torch.testing.assert_close(loss.metrics["aux_loss"], want)


def test_pretraining_data_notices(capsys, monkeypatch):
    """Pre-training reads Megatron's GPTDataset: the flags it does not read, and the held-out split, are said."""
    monkeypatch.delenv("RANK", raising=False)
    instruction_only = ["--padded-samples", "--full-shuffle-instruction-dataset"]
    parse_args(BASE + ["--no-shuffle", "--variable-seq-lengths", *instruction_only], engine=CARD)
    noticed = [line.split(": notice: ")[1].split()[0] for line in capsys.readouterr().err.splitlines()]
    assert noticed == ["--split", *instruction_only, "--no-shuffle", "--variable-seq-lengths"]
    parse_args(BASE + ["--split", "100,0,0", "--no-shuffle", "--padded-samples", "--is-instruction-dataset"],
               engine=CARD)
    assert "notice" not in capsys.readouterr().err     # instruction data: MindSpeed-LLM's index reads them
    parse_args(BASE + ["--is-instruction-dataset"], engine=CARD)   # Megatron's default split holds rows out
    assert [line.split(": notice: ")[1].split()[0] for line in capsys.readouterr().err.splitlines()] == ["--split"]


@pytest.mark.parametrize("split", ["0,0,0", "100,-1,0", "a,b"])
def test_a_split_without_rows_to_train_is_one_named_error(split):
    with pytest.raises(ConfigError, match=f"--split {split}: "):
        parse_args(BASE + ["--split", split, "--is-instruction-dataset"], engine=CARD)


def test_omitted_architecture_switches_are_refused_not_read_as_given():
    """Megatron's defaults without --swiglu / --disable-bias-linear / --normalization / a rotary
    --position-embedding-type build a model no family here has: each omission is one refusal line."""
    from tests.llm.test_published_scripts import refused_flags

    rest = BASE[len(ARCH):]
    with pytest.raises(ConfigError) as err:
        parse_args(rest, engine=CARD)
    assert refused_flags(str(err.value)) == ["--swiglu", "--disable-bias-linear", "--normalization",
                                             "--position-embedding-type"]
    assert len(str(err.value).splitlines()) == 5
    rotary = [a for a in BASE if a not in ("--position-embedding-type", "rope")] + ["--use-rotary-position-embeddings"]
    assert parse_args(rotary, engine=CARD).model.model_id == CARD["model_id"]
    for extra, flag in ((["--num-query-groups", "2"], "--num-query-groups"),
                        (["--kv-lora-rank", "8", "--v-head-dim", "8"], "--kv-lora-rank")):
        with pytest.raises(ConfigError) as err:
            parse_args(BASE + extra, engine=CARD)
        assert refused_flags(str(err.value)) == [flag]


def test_value_flags_without_effect_are_one_notice_each(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    given = ["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec", "--transformer-impl", "local",
             "--shape-order", "BNSD", "--manual-gc-interval", "50", "--num-workers", "4",
             "--distributed-backend", "nccl", "--eval-interval", "10", "--eval-iters", "2",
             "--attention-mask-type", "general"]
    parse_args(BASE + ["--split", "100,0,0"] + given, engine=CARD)
    noticed = [line.split(": notice: ")[1].split()[0] for line in capsys.readouterr().err.splitlines()]
    assert noticed == [a for a in given if a.startswith("--")]
    with pytest.raises(ConfigError, match="--shape-order: invalid choice"):   # upstream's choices still hold
        parse_args(BASE + ["--shape-order", "XYZ"], engine=CARD)


def test_only_no_pad_to_seq_lengths_makes_batches_dynamic(capsys, monkeypatch):
    """MindSpeed-LLM's collator pads to --pad-to-multiple-of only with --no-pad-to-seq-lengths (which sets
    --variable-seq-lengths itself); --variable-seq-lengths alone pads to --seq-length, said in one notice."""
    monkeypatch.delenv("RANK", raising=False)
    sft = BASE + ["--is-instruction-dataset", "--split", "100,0,0"]
    assert parse_args(sft + ["--no-pad-to-seq-lengths", "--variable-seq-lengths"], engine=CARD).data.dynamic
    assert "notice" not in capsys.readouterr().err
    assert not parse_args(sft + ["--variable-seq-lengths"], engine=CARD).data.dynamic
    assert "notice: --variable-seq-lengths has no effect here" in capsys.readouterr().err


def test_gradient_is_megatrons_mean_of_micro_batch_token_means():
    """Megatron's default reduction (schedules.forward_step: loss_sum / num_tokens × cp / num_microbatches,
    then the data-parallel mean): micro-batches with different numbers of label tokens weigh the same, where
    --calculate-per-token-loss weighs every token the same. Checked on the gradient of a tiny model against
    both references written here. The logged loss is the global token mean (pretrain_gpt.py's reporting) or,
    for --stage sft (posttrain_gpt.py's SFTTrainer.loss_func), the mean of the micro-batch means."""
    from backends.common.trainer import Part, optimize
    from backends.llm.recipe import CausalLMWithLoss, causal_lm_loss
    from backends.models import decoder as models

    cfg = models.ModelConfig(family="qwen3", num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
                             num_kv_heads=1, head_dim=16, vocab_size=64, qk_norm=True)
    torch.manual_seed(0)
    model = CausalLMWithLoss(models.build_model(cfg))
    ids = torch.randint(0, 64, (2, 3, 10))
    labels = ids.clone()
    labels[0, :, :8] = -100                      # micro-batch 0: 6 label tokens, micro-batch 1: 30
    mbs = [{"input_ids": ids[i], "labels": labels[i], "n_tokens": (labels[i] != -100).sum()} for i in range(2)]

    class KeepGrads(torch.optim.SGD):   # optimize() clears the gradients after its step: keep them to compare
        def zero_grad(self, set_to_none=True):
            pass

    def grads(cp, log_means=False):
        model.zero_grad(set_to_none=True)
        part = Part(model, KeepGrads(model.parameters(), lr=0.0))
        res = optimize(part, mbs, lambda m, mb: causal_lm_loss(m, mb, cp=cp, log_means=log_means),
                       device=torch.device("cpu"))
        return res.loss, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def reference(per_token):
        model.zero_grad(set_to_none=True)
        sums = [model(mb["input_ids"], mb["labels"])[0] for mb in mbs]
        counts = [float(mb["n_tokens"]) for mb in mbs]
        total = sum(sums) / sum(counts) if per_token else sum(s / c for s, c in zip(sums, counts)) / len(mbs)
        total.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    logged_megatron, megatron = grads(1)
    logged_per_token, per_token = grads(None)
    for got, want in ((megatron, reference(False)), (per_token, reference(True))):
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert logged_megatron == pytest.approx(logged_per_token)
    logged_sft, sft = grads(1, log_means=True)
    with torch.no_grad():
        means = [float(model(mb["input_ids"], mb["labels"])[0]) / float(mb["n_tokens"]) for mb in mbs]
    assert logged_sft == pytest.approx(sum(means) / 2) and logged_sft != pytest.approx(logged_megatron)
    assert all(torch.equal(a, b) for a, b in zip(sft, megatron))   # the logging only
    assert max(float((a - b).abs().max()) for a, b in zip(megatron, per_token)) > 1e-4   # the two rules differ here
