"""--load of a Megatron checkpoint (issue 30 §4): the legacy torch format MindSpeed-LLM's converter writes and
megatron-core's torch_dist, read at any layout (backends/common/checkpoint/megatron_checkpoint.py, megatron_view.py,
backends/llm/megatron_load.py).

The upstream tools' own output (tests/fixtures/upstream/megatron-checkpoints: MindSpeed-LLM's converter, megatron-
core's dist_checkpointing) reads back to the HF weights it was made from, and the writers
(tests/helpers/megatron_writers.py) reproduce it tensor for tensor; those writers then make tp 2 / pp 2 checkpoints of the tiny test models, which the engine
loads at tp 1 with transformers' logits, and trains on two processes from the same first loss as from the HF
directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backends.common.checkpoint.megatron_checkpoint import open_checkpoint
from backends.common.checkpoint.megatron_view import MegatronView, MlaDims, Naming
from backends.common.checkpoint.slices import full_region
from backends.llm.config import ConfigError, parse_args
from tests.helpers.megatron_writers import dims, dist_tensors, hf_weights, write_dist, write_legacy

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "tests" / "fixtures" / "upstream" / "megatron-checkpoints"
ALPACA = ROOT / "examples" / "data" / "arithmetic_alpaca.json"


def _naming(model_dir: Path) -> Naming:
    cfg = hf_weights(model_dir)[1]
    _, _, heads, groups, head_dim = dims(cfg)
    mla = MlaDims(*(cfg[k] for k in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))) \
        if "kv_lora_rank" in cfg else None
    return Naming(heads, groups, head_dim, mla=mla)


# ---------------------------------------------------------------------- the upstream tools' checkpoints


@pytest.mark.parametrize("model,kind,layout", [("dense", "legacy", (2, 2, 1)), ("moe", "legacy", (2, 2, 1)),
                                               ("moe", "torch_dist", None), ("mla-lite", "legacy", (2, 2, 2)),
                                               ("mla-v3", "legacy", (2, 2, 1)), ("mla-v3", "legacy-mm-split", (2, 2, 1)),
                                               ("mla-v3", "torch_dist", None)])
def test_checkpoints_the_upstream_tools_wrote_read_back_to_their_hf_weights(model, kind, layout):
    hf, cfg = hf_weights(UPSTREAM / model / "hf")
    ckpt = open_checkpoint(UPSTREAM / model / kind)
    assert (ckpt.format, ckpt.iteration, ckpt.release, ckpt.holds) == (
        "torch_dist" if kind == "torch_dist" else "torch", 1, False, set())
    assert (ckpt.files and (ckpt.files.tp, ckpt.files.pp, ckpt.files.ep)) == layout
    view = MegatronView(ckpt, _naming(UPSTREAM / model / "hf"))
    assert sorted(hf) == sorted(n for n in view.names() if not (n == "lm_head.weight" and cfg["tie_word_embeddings"]))
    for name, tensor in hf.items():
        assert torch.equal(view.read(name, full_region(view.shape(name))), tensor), name


def test_the_writers_reproduce_the_upstream_checkpoints(tmp_path):
    """The checkpoints the engine tests below load are written as MindSpeed-LLM's converter and megatron-core write
    theirs: the same keys, shapes and values."""
    for model, kind, switches in (("dense", "legacy", {}), ("moe", "legacy", {"grouped": True}),
                                  ("mla-lite", "legacy", {"grouped": True, "ep": 2}),
                                  ("mla-v3", "legacy", {"grouped": True}),
                                  ("mla-v3", "legacy-mm-split", {"grouped": True, "mla_mm_split": True})):
        mine = write_legacy(UPSTREAM / model / "hf", tmp_path / model / kind, tp=2, pp=2, **switches)
        for theirs in sorted((UPSTREAM / model / kind / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt")):
            want = torch.load(theirs, weights_only=False)
            got = torch.load(mine / "iter_0000001" / theirs.parent.name / theirs.name, weights_only=False)
            assert (got["iteration"], got["checkpoint_version"]) == (want["iteration"], want["checkpoint_version"])
            assert sorted(got["model"]) == sorted(want["model"]), theirs
            for key, value in want["model"].items():
                assert torch.equal(got["model"][key], value), (theirs, key)
    store = open_checkpoint(UPSTREAM / "moe" / "torch_dist").store
    want = {k: store.read(k, full_region(store.shape(k))) for k in store.keys()}
    got = dist_tensors(UPSTREAM / "moe" / "hf")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------- the engine


QWEN3 = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--qk-layernorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--padded-vocab-size", "512",
         "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--normalization", "RMSNorm"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
# tests/helpers/tiny_hf.py's DeepSeek-V2-Lite, as MindSpeed-LLM's deepseek2_lite scripts describe it
DEEPSEEK2_LITE = QWEN3[:QWEN3.index("--group-query-attention")] + QWEN3[QWEN3.index("--swiglu"):] + MOE + [
    "--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
    "--v-head-dim", "16", "--qk-layernorm", "--n-shared-experts", "1", "--first-k-dense-replace", "1",
    "--moe-router-load-balancing-type", "pai_megatron_aux_loss"]
FLAGS = {"qwen3": QWEN3, "qwen3_moe": QWEN3 + MOE, "deepseek_v2": DEEPSEEK2_LITE}
RUN = ["--data-path", "x", "--seq-length", "32", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "3"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    """family -> (HF dir, its tp 2 / pp 2 legacy checkpoint (MoE: grouped GEMM; DeepSeek: ep 2 too), its torch_dist
    checkpoint)."""
    out = {}
    for family in ("qwen3", "qwen3_moe", "deepseek_v2"):
        hf = tiny_model(family)
        base = tmp_path_factory.mktemp(f"megatron-{family}")
        out[family] = (hf, write_legacy(hf, base / "legacy", tp=2, pp=2, grouped=family != "qwen3",
                                        ep=2 if family == "deepseek_v2" else 1),
                       write_dist(hf, base / "torch_dist") if family != "deepseek_v2" else None)
    return out


def _load_in_process(argv):
    from backends.llm.megatron_load import checkpoint_reader, megatron_start
    from backends.llm.recipe import build_decoder, resume_setting
    from backends.models.decoder import loading

    cfg = parse_args(argv, engine={})
    start = megatron_start(cfg, resume_setting(cfg))
    decoder = build_decoder(cfg)
    loading.materialize(decoder, decoder, torch.device("cpu"), reader=checkpoint_reader(start, decoder))
    return decoder, start


@pytest.mark.parametrize("family,kind", [("qwen3", "legacy"), ("qwen3", "dist"), ("qwen3_moe", "legacy"),
                                         ("qwen3_moe", "dist"), ("deepseek_v2", "legacy")])
def test_engine_loads_the_checkpoint_at_tp1_with_transformers_logits(checkpoints, family, kind):
    import transformers

    hf, legacy, dist = checkpoints[family]
    decoder, start = _load_in_process(FLAGS[family] + RUN + ["--load", str(legacy if kind == "legacy" else dist),
                                                             "--finetune"])
    assert decoder.config.family == family and start.start_step == 0
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(decoder(ids), reference(ids).logits, rtol=0, atol=1e-5)


def test_megatron_rules_for_which_checkpoint_and_iteration(checkpoints, tmp_path):
    """Megatron's load_checkpoint: --finetune and release start at 0; otherwise the saved iteration with what
    --no-load-optim / --no-load-rng leave out, an optimizer or rng state it cannot restore refused by name; the
    flags must describe the checkpoint; the engine's own checkpoints in the same folder win."""
    from backends.common import kit
    from backends.common.checkpoint.resume import MARKER
    from backends.llm.megatron_load import megatron_start
    from backends.llm.recipe import resume_setting

    hf, legacy, dist = checkpoints["qwen3"]

    def start(load, *flags):
        cfg = parse_args(QWEN3 + RUN + ["--load", str(load), *flags], engine={})
        return megatron_start(cfg, resume_setting(cfg))

    assert start(legacy, "--finetune").start_step == 0
    assert start(dist, "--no-load-optim", "--no-load-rng").start_step == 1   # continues at iteration 1
    with pytest.raises(ConfigError, match=r"--load .*: iteration 1, .*holds no optimizer state.*give --no-load-optim"
                                          r".*holds no rng state.*give --no-load-rng"):
        start(legacy)
    with_optim = write_legacy(hf, tmp_path / "optim", tp=1, pp=1, iteration=7, extra={"optimizer": {}})
    with pytest.raises(ConfigError, match="iteration 7.*restoring Megatron's optimizer state is not built; give "
                                          "--no-load-optim"):
        start(with_optim, "--no-load-rng")
    assert start(with_optim, "--finetune").start_step == 0
    assert start(write_legacy(hf, tmp_path / "release", tp=1, pp=1, release=True)).start_step == 0
    with pytest.raises(ConfigError, match="torch_dist checkpoint and --ckpt-format torch reads legacy ones only"):
        start(dist, "--finetune", "--ckpt-format", "torch")
    with pytest.raises(ConfigError, match=r"--num-layers 3 \(it was saved with 2\)"):
        _load_in_process([*QWEN3, *RUN, "--num-layers", "3", "--load", str(legacy), "--finetune"])
    with pytest.raises(ConfigError, match=r"is not the model the flags describe: .*linear_fc1.weight gives "
                                          r"model.layers.0.mlp.gate_proj.weight of shape \(128, 64\), the model needs "
                                          r"\(96, 64\)"):
        _load_in_process([*QWEN3, *RUN, "--ffn-hidden-size", "96", "--load", str(legacy), "--finetune"])
    with pytest.raises(ConfigError, match=r"--load \S+: layer 0's linear_qkv has 64 rows per tensor-parallel shard, "
                                          r"not a whole number of query groups of 24 rows"):
        _load_in_process([*QWEN3, *RUN, "--num-query-groups", "4", "--kv-channels", "8", "--load", str(legacy),
                          "--finetune"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latest_checkpointed_iteration.txt").write_text("latest")
    with pytest.raises(ConfigError, match=r"--load .*bad: .*says 'latest'; Megatron expects 'release' or an "
                                          "iteration number"):
        start(bad, "--finetune")
    step = legacy / "step_2"   # the engine's own checkpoint there: resumed, the Megatron one left alone
    step.mkdir()
    for name in (MARKER, ".metadata", "rank_0.pt"):
        (step / name).write_text("{}")
    try:
        assert start(legacy) is None
    finally:
        for name in (MARKER, ".metadata", "rank_0.pt"):
            (step / name).unlink()
        step.rmdir()
    with pytest.raises(ConfigError, match="holds a Megatron checkpoint and load_hf .* two sets of weights"):
        cfg = parse_args(QWEN3 + RUN + ["--load", str(legacy), "--finetune"], engine={"load_hf": str(hf)})
        megatron_start(cfg, resume_setting(cfg))
    # --exit-on-missing-checkpoint is satisfied by it; an engine that reads none names it
    assert start(legacy, "--finetune", "--exit-on-missing-checkpoint") is not None
    with pytest.raises(ValueError, match="holds a Megatron checkpoint .*this engine resumes its own"):
        kit.megatron_resume(str(legacy), None)


@pytest.mark.parametrize("script,card", [("tune_llama31_8b_4k_full_ptd", "llama3.1-8b"),
                                         ("tune_glm4_9b_32k_full_ptd", "glm-4-9b-chat")])
def test_published_scripts_loading_megatron_checkpoints_build_their_models(script, card, tmp_path):
    """MindSpeed-LLM's Llama 3.1 and GLM-4 tune scripts --load a Megatron checkpoint: their flags alone build the
    model of the card (llama3 rope scaling, GLM's half interleaved rotary, biases, vocabulary); the sequence length
    they train at stands for max_position_embeddings, which nothing computed reads."""
    import dataclasses

    from backends.llm.megatron_load import flags_config
    from backends.models.decoder import card_config

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    argv = [line for line in (ROOT / "tests" / "fixtures" / "upstream" / "mindspeed-llm" / "published_args" /
                              f"{script}.args").read_text().splitlines() if not line.startswith("#")]
    argv[argv.index("--load") + 1] = str(tmp_path)
    got, want = flags_config(parse_args(argv, engine={})), card_config(card)
    assert {f.name for f in dataclasses.fields(want) if getattr(got, f.name) != getattr(want, f.name)} == {
        "max_position_embeddings"}


def test_published_script_flags_build_the_model_megatron_builds(tiny_model):
    """Without a model card or HF directory the flags are the model, as in Megatron: the family they describe, its
    vocabulary the tokenizer's padded as Megatron pads it (--make-vocab-size-divisible-by x tp)."""
    from backends.llm.megatron_load import flags_config

    hf = str(tiny_model("qwen3"))
    flags = [f for f in QWEN3 if f not in ("--padded-vocab-size", "512")] + RUN
    cfg = parse_args(flags + ["--load", str(UPSTREAM / "dense" / "legacy"), "--tokenizer-name-or-path", hf,
                              "--tensor-model-parallel-size", "2"], engine={})
    from backends.common.data import load_tokenizer

    model = flags_config(cfg)
    assert model.family == "qwen3" and model.vocab_size % 256 == 0 and 0 <= model.vocab_size - len(
        load_tokenizer(hf)) < 256
    llama = [f for f in QWEN3 if f != "--qk-layernorm"]
    assert flags_config(parse_args(llama + RUN + ["--load", str(UPSTREAM / "dense" / "legacy")], engine={})) \
        .family == "llama"
    assert flags_config(parse_args(llama + RUN + ["--add-qkv-bias", "--load", str(UPSTREAM / "dense" / "legacy")],
                                   engine={})).family == "qwen2"
    with pytest.raises(ConfigError, match="--swiglu is not given: Megatron builds a GELU MLP"):
        parse_args([f for f in QWEN3 if f != "--swiglu"] + RUN + ["--load", str(UPSTREAM / "dense" / "legacy")],
                   engine={})
    with pytest.raises(ConfigError, match="or --load a Megatron checkpoint"):
        parse_args(QWEN3 + RUN + ["--load", str(hf)], engine={})
    # MLA flags describe DeepSeek-V2 (MindSpeed-LLM's deepseek2-lite); what they leave open is named
    mla = parse_args(DEEPSEEK2_LITE + RUN + ["--load", str(UPSTREAM / "mla-lite" / "legacy")], engine={})
    model = flags_config(mla)
    assert (model.family, model.mla.kv_lora_rank, model.moe.shared_experts, model.moe.first_k_dense,
            model.moe.norm_topk_prob) == ("deepseek_v2", 16, 1, 1, False)
    at = DEEPSEEK2_LITE.index("--kv-lora-rank")
    lacking = [f for f in DEEPSEEK2_LITE[:at] + DEEPSEEK2_LITE[at + 2:] if f != "--qk-layernorm"]
    with pytest.raises(ConfigError, match=r"--kv-lora-rank: give it .*; --multi-latent-attention without "
                                          r"--qk-layernorm: .* latent norms"):
        parse_args(lacking + RUN + ["--load", str(UPSTREAM / "mla-lite" / "legacy")], engine={})
    with pytest.raises(ConfigError, match="--n-shared-experts: shared experts and dense leading layers are DeepSeek's"):
        parse_args(QWEN3 + MOE + ["--n-shared-experts", "1"] + RUN + ["--load", str(UPSTREAM / "dense" / "legacy")],
                   engine={})


def test_training_from_the_checkpoint_at_tp2_starts_from_the_hf_loss(checkpoints, engine_runs, tmp_path_factory):
    """On two processes (the checkpoints were written at tp 2 / pp 2, DeepSeek's at ep 2 too): at tp 2 the legacy
    checkpoint with --finetune and the torch_dist one continuing at its iteration 1 (--no-load-optim --no-load-rng:
    steps 2 and 3, as Megatron numbers them) start from the loss the HF directory gives; DeepSeek-V2-Lite's (multi-
    latent attention, shared experts, a dense first layer) at tp 2 and at ep 2 from its HF directory's; one launch."""
    hf, legacy, dist = checkpoints["qwen3"]
    mla_hf, mla_legacy, _ = checkpoints["deepseek_v2"]
    work = tmp_path_factory.mktemp("megatron-train")
    data = ["--input", str(ALPACA), "--handler-name", "AlpacaStyleInstructionHandler", "--prompt-type", "qwen",
            "--data-path", str(work / "data" / "alpaca"), "--max-samples", "16", "--tokenizer-type",
            "PretrainedFromHF", "--tokenizer-name-or-path", str(hf), "--seq-length", "64", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "3", "--log-interval", "1"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    cases = {"hf": QWEN3 + tp2 + ["--enable-hf2mg-convert", "--load", str(hf), "--model-type-hf", "qwen3"],
             "legacy": QWEN3 + tp2 + ["--load", str(legacy), "--finetune"],
             "dist": QWEN3 + tp2 + ["--load", str(dist), "--no-load-optim", "--no-load-rng"],
             "mla-hf": DEEPSEEK2_LITE + tp2 + ["--enable-hf2mg-convert", "--load", str(mla_hf), "--model-type-hf",
                                              "deepseek2-lite"],
             "mla-legacy": DEEPSEEK2_LITE + tp2 + ["--load", str(mla_legacy), "--finetune"],
             "mla-ep2": DEEPSEEK2_LITE + ["--expert-model-parallel-size", "2", "--load", str(mla_legacy), "--finetune"]}
    for name, flags in cases.items():
        engine = work / f"{name}.yaml"
        engine.write_text(f"metrics_file: {work / name / 'metrics.jsonl'}\n")
        engine_runs.add_command(f"megatron-load-{name}", "backends.llm", flags + data, work / name, world=2,
                                env={"AF_ENGINE_FILE": str(engine)})
    steps = {}
    for name in cases:
        engine_runs[f"megatron-load-{name}"]
        records = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        steps[name] = {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}
    assert sorted(steps["hf"]) == sorted(steps["legacy"]) == [1, 2, 3] and sorted(steps["dist"]) == [2, 3]
    first = steps["hf"][1]
    assert steps["legacy"][1] == pytest.approx(first, rel=1e-6) and steps["dist"][2] == pytest.approx(first, rel=1e-6)
    assert steps["legacy"] == pytest.approx(steps["hf"], rel=1e-5)
    assert steps["mla-legacy"][1] == pytest.approx(steps["mla-hf"][1], rel=1e-6) and steps["mla-hf"][1] != first
    assert steps["mla-legacy"] == pytest.approx(steps["mla-hf"], rel=1e-5)
    assert steps["mla-ep2"][1] == pytest.approx(steps["mla-hf"][1], rel=1e-5)
