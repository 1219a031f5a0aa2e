"""backends.rl reads MindSpeed-RL's own YAML (backends/rl/mindspeed_rl/): its key tables are
MindSpeed-RL's (../shared/upstream/mindspeed-rl-config-keys.tsv); the file rendered from
examples/mindspeed-rl/grpo.yaml parses to the RLConfig of the same job rendered for VeRL where the two
overlap (the same prompt ids too); an unknown key is refused with a did-you-mean, an unimplemented key
away from MindSpeed-RL's default by name, PP > 1 as pending (TP and CP parse, with num_npus a multiple); the published
upstream example is refused by name for what a local CPU run cannot have (PP 2, Megatron
checkpoint and dataset paths) and parses once those point at local files; the templates and verifiers
on hand-worked cases; a bad file ends `python -m backends.rl` with one message and exit 2."""

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ascendfactory.job_file import load_job
from ascendfactory.plan import make_plan
from ascendfactory.render import render, write_files
from backends.rl import config as rlconfig
from backends.rl import dialects
from backends.rl import mindspeed_rl as msrl
from backends.rl.config import RLConfigError

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")
TSV = UPSTREAM / "mindspeed-rl-config-keys.tsv"
PUBLISHED = UPSTREAM / "mindspeed-rl-grpo_qwen25_7b_A3.yaml"
PUBLISHED_MODEL = UPSTREAM / "mindspeed-rl-model-qwen25_7b.yaml"
TINY = ROOT / "examples" / "tiny-qwen3-arith"


def upstream(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM} (set AF_UPSTREAM_DIR)")
    return path


def rendered(example: str, out: Path) -> Path:
    """The example's files written into out (the run directory `ascendfactory run` would make)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        plan = make_plan(load_job(ROOT / example), check_memory=False)
        write_files(render(plan, out), out)
    finally:
        os.chdir(cwd)
    return out


@pytest.fixture(scope="module")
def msrl_dir(tmp_path_factory):
    return rendered("examples/mindspeed-rl/grpo.yaml", tmp_path_factory.mktemp("msrl"))


def parse(run_dir: Path, change=None, side: dict | None = None) -> rlconfig.RLConfig:
    """The rendered mindspeed_rl.yaml (composed with its model file), edited by change(tree), parsed
    (side: engine.yaml settings changed)."""
    tree, origin = msrl.compose(msrl.read_yaml(run_dir / "mindspeed_rl.yaml"), run_dir / "mindspeed_rl.yaml")
    if change:
        change(tree)
    engine = {**yaml.safe_load((run_dir / "engine.yaml").read_text()), **(side or {})}
    return msrl.parse_mindspeed_rl(tree, engine, source=str(run_dir / "mindspeed_rl.yaml"), model_files=origin)


def refused(run_dir: Path, change, side: dict | None = None) -> str:
    with pytest.raises(RLConfigError) as info:
        parse(run_dir, change, side)
    return str(info.value)


# ---------------------------------------------------------------------- the tables are MindSpeed-RL's


def test_key_tables_are_mindspeed_rl_s():
    tsv: dict[str, dict[str, str]] = {}
    for line in upstream(TSV).read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sections, _, key, default = line.split("\t")
        tsv.setdefault(sections.split(" / ")[0], {})[key] = default
    for section, table in (("megatron_training", msrl.MEGATRON), ("rl_config", msrl.RL),
                           ("generate_config", msrl.GENERATE)):
        assert set(table) == set(tsv[section]), section
        for key, default in tsv[section].items():
            try:
                value = ast.literal_eval(default)
            except (ValueError, SyntaxError):
                continue  # computed from other keys (self.x, config_dict.get(...), TEMPLATES_DIR, 2 ** 32)
            if table[key] is not msrl.DERIVED and key not in ("n_samples_per_prompt", "mini_batch_size"):
                assert table[key] == value, (section, key)
    assert msrl.MEGATRON["initial_loss_scale"] == 2 ** 32
    assert (msrl.RL["n_samples_per_prompt"], msrl.RL["mini_batch_size"]) == (1, 1)  # config_dict.get(..., 1)
    assert tsv["generate_config"]["sampling_config"].startswith('{             "logprobs": 1,             '
                                                                '"max_tokens": 128,')
    for kind, table in (("megatron", msrl.MEGATRON), ("rl", msrl.RL), ("generate", msrl.GENERATE)):
        assert msrl.NO_EFFECT[kind] <= set(table), kind
    assert set(msrl.ARCH_KEYS) <= set(msrl.MEGATRON) and set(msrl.PARALLEL) <= set(msrl.MEGATRON)


# ---------------------------------------------------------------------- the same job as VeRL's


def test_rendered_file_parses_like_the_verl_job(msrl_dir, tmp_path):
    """examples/mindspeed-rl/grpo.yaml and examples/verl/grpo.yaml are one job in two dialects: wherever
    both files say it, the engine gets the same setting, and the same prompt token ids."""
    import transformers

    from backends.rl.data import load_records

    verl_dir = rendered("examples/verl/grpo.yaml", tmp_path / "verl")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        ms = dialects.load(msrl_dir / "mindspeed_rl.yaml", engine=msrl_dir / "engine.yaml")
        ve = dialects.load(verl_dir / "verl_config.yaml", engine=verl_dir / "engine.yaml")
        ve.records = load_records(ve, transformers.AutoTokenizer.from_pretrained(ve.model_path))
    finally:
        os.chdir(cwd)
    overlap = ("model_path", "algorithm", "max_prompt_length", "shuffle", "data_seed", "rollout_engine", "n",
               "max_new_tokens", "temperature", "top_p", "top_k", "train_batch_size", "mini_batch_size",
               "micro_batch_size", "ppo_epochs", "lr", "weight_decay", "betas", "grad_clip", "warmup_steps",
               "warmup_ratio", "gradient_checkpointing", "clip_low", "clip_high", "loss_agg_mode", "entropy_coeff",
               "use_kl_loss", "kl_loss_coef", "kl_loss_type", "norm_adv_by_std", "gamma", "lam", "use_kl_in_reward",
               "filter_groups", "overlong_buffer", "total_steps", "expected_world", "seed", "precision",
               "kernel_backend", "kernel_overrides", "eos_token_id", "stop")
    a, b = dataclasses.asdict(ms), dataclasses.asdict(ve)
    assert {k: a[k] for k in overlap} == {k: b[k] for k in overlap}
    assert (a["train_batch_size"], a["mini_batch_size"], a["micro_batch_size"], a["n"]) == (8, 4, 8, 8)
    # the rows: one prompt each, the same ids (qwen3 template = the tokenizer's chat template), the same answer
    assert [r["prompt_ids"] for r in ms.records] == [r["prompt_ids"] for r in ve.records]
    assert [r["ground_truth"] for r in ms.records] == [r["ground_truth"] for r in ve.records]
    # the verifier: VeRL routes by data_source (openai/gsm8k), MindSpeed-RL names it
    assert ve.verifier is None and {r["data_source"] for r in ve.records} == {"openai/gsm8k"}
    assert ms.verifier == "gsm8k" and ms.reward_function is None
    # MindSpeed-RL's own meanings: its GRPO loss has no dual clip; the output paths are its own
    assert ms.clip_c == msrl.NO_DUAL_CLIP and ve.clip_c == 3.0
    assert ms.save_dir == str(msrl_dir / "checkpoints") and ms.metrics_file == str(msrl_dir / "metrics.jsonl")


def test_feature_values_map_as_mindspeed_rl_means_them(msrl_dir):
    def edit(tree):
        # actor_config on top of megatron_training (MindSpeed-RL's {**megatron_training, **actor_config})
        tree["megatron_training"].update(global_batch_size=16, lr_warmup_fraction=0.3, bf16=False)
        tree["actor_config"].update(micro_batch_size=8, recompute_granularity="full", adam_beta1=0.8,
                                    lr_warmup_fraction=0.1)
        tree["rl_config"].update(mini_batch_size=2, n_samples_per_prompt=4, epochs=2, clip_higher_enable=True,
                                 clip_ratio_low=0.2, clip_ratio_high=0.28, init_kl_coef=0.05, kl_penalty="mse",
                                 entropy_coeff=0.01, token_level_loss=False, verifier_function=["math_17k_acc"])
        tree["generate_config"]["sampling_config"] = {"max_tokens": 6, "top_k": 5}  # the rest: vLLM's fallbacks
    cfg = parse(msrl_dir, edit)
    assert (cfg.train_batch_size, cfg.mini_batch_size, cfg.micro_batch_size, cfg.n) == (16, 2, 8, 4)
    assert (cfg.ppo_epochs, cfg.warmup_ratio, cfg.gradient_checkpointing, cfg.betas) == (2, 0.1, True, (0.8, 0.95))
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28)
    assert (cfg.use_kl_loss, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.entropy_coeff) == (True, 0.05, "mse", 0.01)
    assert cfg.loss_agg_mode == "seq-mean-token-mean" and cfg.verifier == "math"
    assert (cfg.max_new_tokens, cfg.top_k, cfg.temperature, cfg.top_p) == (6, 5, 0.2, 1.0)
    # clip_ratio_low / high only count with clip_higher_enable (MindSpeed-RL's DAPO loss reads them so)
    cfg = parse(msrl_dir, lambda t: t["rl_config"].update(clip_ratio=0.3, clip_ratio_low=0.1, clip_ratio_high=0.4))
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.3)
    # base_acc, MindSpeed-RL's default verifier, is this module's function through rewards.load_function
    cfg = parse(msrl_dir, lambda t: t["rl_config"].pop("verifier_function"))
    from backends.rl.rewards import load_function

    assert cfg.verifier is None and load_function(cfg.reward_function) is msrl.base_acc


# ---------------------------------------------------------------------- refused by name


def test_unknown_key_is_refused_by_name_with_did_you_mean(msrl_dir):
    source = str(msrl_dir / "mindspeed_rl.yaml")
    text = refused(msrl_dir, lambda t: t["rl_config"].update(init_kl_coeff=0.01))
    assert text.startswith(source + ": ")
    assert "rl_config.init_kl_coeff: not a MindSpeed-RL RLConfig key (did you mean init_kl_coef?)" in text
    text = refused(msrl_dir, lambda t: t["actor_config"].update(mini_batch_size=4))
    assert "actor_config.mini_batch_size: not a MindSpeed-RL MegatronConfig key (did you mean micro_batch_size?)" \
        in text
    text = refused(msrl_dir, lambda t: t["generate_config"]["sampling_config"].update(temprature=0.7))
    assert "generate_config.sampling_config.temprature: not a MindSpeed-RL sampling_config key (did you mean " \
           "temperature?)" in text
    text = refused(msrl_dir, lambda t: t.update(rl_confg={}))
    assert "rl_confg: not a section of MindSpeed-RL's config classes" in text and "did you mean rl_config?" in text
    # a key of the model file: named with the model file's path
    text = refused(msrl_dir, lambda t: t["model"]["qwen25_7b"].update(num_layer=2))
    assert f"{msrl_dir / 'model' / 'qwen25_7b.yaml'}: qwen25_7b.num_layer: not a MindSpeed-RL MegatronConfig key " \
           "(did you mean num_layers?)" in text


def test_unimplemented_key_is_refused_unless_at_mindspeed_rl_s_default(msrl_dir):
    text = refused(msrl_dir, lambda t: t["rl_config"].update(shuffle_mini_batch=True))
    assert "rl_config.shuffle_mini_batch: MindSpeed-RL's key, but this engine does not implement it " \
           "(MindSpeed-RL's default is False" in text
    parse(msrl_dir, lambda t: t["rl_config"].update(shuffle_mini_batch=False))       # its default: accepted
    parse(msrl_dir, lambda t: t["rl_config"].update(use_wandb=True, blocking=False))  # no effect on a step
    text = refused(msrl_dir, lambda t: t["megatron_training"].update(vocab_extra_ids=4))
    assert "megatron_training.vocab_extra_ids: MindSpeed-RL's key, but this engine does not implement it" in text
    for section, key, value, words in (
            ("rl_config", "use_kl_in_reward", True, "does not read this key"),
            ("rl_config", "adv_estimator", "gae", "GAE (PPO) runs in the VeRL dialect"),
            ("megatron_training", "stage", "ray_dapo", "DAPO and PPO run in the VeRL dialect"),
            ("rl_config", "kl_ctrl_type", "adaptive", "a fixed KL coefficient"),
            ("rl_config", "verifier_function", ["acc_for_dapo"], "'acc_for_dapo' is MindSpeed-RL's, but not built"),
            ("rl_config", "verifier_function", ["gsm8"], "did you mean gsm8k?"),
            ("megatron_training", "prompt_type", "qwen2", "not a MindSpeed-RL template name (did you mean qwen?)"),
            ("actor_config", "lr_decay_style", "cosine", "a constant learning rate"),
            ("megatron_training", "hidden_dropout", 0.1, "no dropout"),
            ("generate_config", "dtype", "bfloat16", "the actor trains in fp32"),
            ("generate_config", "infer_tensor_parallel_size", 2,
             "the rollout samples on the actor, under its actor_config.tensor_model_parallel_size); set 1")):
        text = refused(msrl_dir, lambda t: t[section].update({key: value}))
        assert f"{section}.{key}" in text and words in text, (key, text)
    # a default the engine does not run is named as MindSpeed-RL's default
    text = refused(msrl_dir, lambda t: t["actor_config"].pop("lr_decay_style"))
    assert "actor_config.lr_decay_style (MindSpeed-RL's default): 'linear' is not built in this engine" in text


def test_tensor_and_context_parallel_parse_pipeline_is_refused(msrl_dir):
    def actor_tp(tp, npus=2):
        return lambda t: (t["actor_config"].update(tensor_model_parallel_size=tp),
                          t["rl_config"]["actor_resource"].update(num_npus=npus))
    assert parse(msrl_dir, actor_tp(2)).tp == 2 and parse(msrl_dir).tp == 1
    assert "num_npus: 3 is not a multiple of actor_config.tensor_model_parallel_size 2" in \
        refused(msrl_dir, actor_tp(2, 3))
    # CP parses (tests/rl/test_rl_context_parallel.py: its refusals), read through megatron_training too
    cfg = parse(msrl_dir, lambda t: (t["actor_config"].pop("context_parallel_size"),
                                     t["megatron_training"].update(context_parallel_size=2,
                                                                   context_parallel_algo="megatron_cp_algo"),
                                     t["rl_config"]["actor_resource"].update(num_npus=2)))
    assert (cfg.cp, cfg.cp_algo) == (2, "ring")
    text = refused(msrl_dir, lambda t: t["actor_config"].update(pipeline_model_parallel_size=4))
    assert "actor_config.pipeline_model_parallel_size: 4" in text
    # the rollout's tp: the actor's (the in-repo generator samples on the tp actor) or 1; vLLM's engines: 1

    def infer(size):
        return lambda t: (actor_tp(2)(t), t["generate_config"].update(infer_tensor_parallel_size=size))
    assert parse(msrl_dir, infer(2)).tp == 2 and parse(msrl_dir, infer(1)).tp == 2
    assert "generate_config.infer_tensor_parallel_size: 4 is not built in this engine" in refused(msrl_dir, infer(4))
    assert "set 1 or 2" in refused(msrl_dir, infer(4))
    text = refused(msrl_dir, infer(2), side={"rollout_engine": "vllm"})
    assert "infer_tensor_parallel_size: 2" in text and "one vLLM engine per rank holds the whole weights" in text

    def reference(tp, actor=1):
        def edit(tree):
            actor_tp(actor)(tree)
            tree["rl_config"]["use_integrated_worker"] = False
            tree["rl_config"]["reference_resource"] = {"num_npus": 2}  # MindSpeed-RL reads it then
            tree["ref_config"] = {"tensor_model_parallel_size": tp, "micro_batch_size": 4,
                                  "load": tree["actor_config"]["load"]}
        return edit
    assert parse(msrl_dir, reference(1)).ref_tp == 1
    assert parse(msrl_dir, reference(2, actor=2)).ref_tp == 2 and parse(msrl_dir, reference(1, actor=2)).ref_tp == 1
    assert "ref_config.tensor_model_parallel_size: 2: the engine's reference is replicated or on the actor's " \
        "tensor parallel layout (1)" in refused(msrl_dir, reference(2))


def test_model_file_must_describe_the_checkpoint(msrl_dir):
    name = str(msrl_dir / "model" / "qwen25_7b.yaml")
    text = refused(msrl_dir, lambda t: t["model"]["qwen25_7b"].update(num_layers=28))
    assert f"{name}: qwen25_7b.num_layers: 28, but examples/tiny-qwen3-arith/config.json has 2" in text
    text = refused(msrl_dir, lambda t: t["model"]["qwen25_7b"].pop("normalization"))
    assert "normalization (MindSpeed-RL's default): 'LayerNorm', but" in text
    text = refused(msrl_dir, lambda t: t["model"]["qwen25_7b"].update(num_query_groups=4))
    assert f"{name}: qwen25_7b.num_query_groups: 4 gives 4 key/value heads" in text


# ---------------------------------------------------------------------- the published example


@pytest.fixture
def published(tmp_path):
    """MindSpeed-RL's published GRPO config and the model file its defaults names, laid out as upstream."""
    shutil.copy(upstream(PUBLISHED), tmp_path / "grpo_qwen25_7b_A3.yaml")
    (tmp_path / "model").mkdir()
    shutil.copy(upstream(PUBLISHED_MODEL), tmp_path / "model" / "qwen25_7b.yaml")
    return tmp_path / "grpo_qwen25_7b_A3.yaml"


def test_published_example_is_refused_by_name_for_what_a_cpu_run_lacks(published):
    """Every key of the published files is MindSpeed-RL's and every value but these is one the engine
    runs (its TP 2 x PP 2 actor is built): the Megatron checkpoint ./ckpt (not a Hugging Face directory), a
    tokenizer directory other than it, and the data_path prefix (no preprocessed dataset there)."""
    with pytest.raises(RLConfigError) as info:
        msrl.parse_mindspeed_rl(msrl.read_yaml(published), source=str(published))
    text = str(info.value)
    assert text.startswith(str(published) + ": ")
    lines = [line.strip() for line in text.splitlines()[1:]]  # "<file>: 3 problems", then one line each
    named = sorted(p.split(":")[0] for p in lines if p[:1].isalpha() and ": " in p)
    assert named == ["actor_config.load", "megatron_training.data_path",
                     "megatron_training.tokenizer_name_or_path"], text


def test_published_example_parses_with_local_paths_and_tp1(published, tmp_path):
    """With the parallel sizes at 1 and the paths at a Qwen2.5-7B config.json and a JSONL file, the
    published files parse, with MindSpeed-RL's meanings (Hydra's 1e-6 a float; mini_batch_size 32
    prompts; the model file's architecture checked against the config.json)."""
    model = yaml.safe_load(PUBLISHED_MODEL.read_text())["qwen25_7b"]
    hf = tmp_path / "Qwen2.5-7B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_hidden_layers": model["num_layers"], "hidden_size": model["hidden_size"],
        "intermediate_size": model["ffn_hidden_size"], "num_attention_heads": model["num_attention_heads"],
        "num_key_value_heads": model["num_query_groups"], "rope_theta": float(model["rotary_base"]),
        "max_position_embeddings": model["max_position_embeddings"], "vocab_size": model["padded_vocab_size"],
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu"}))
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "labels": "2"}\n')
    tree, origin = msrl.compose(msrl.read_yaml(published), published)
    tree["actor_config"].update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, load=str(hf))
    tree["megatron_training"].update(tokenizer_name_or_path=str(hf), data_path=str(data))
    cfg = msrl.parse_mindspeed_rl(tree, source=str(published), model_files=origin)
    assert (cfg.train_batch_size, cfg.mini_batch_size, cfg.micro_batch_size, cfg.n) == (32, 32, 4, 8)
    assert (cfg.lr, cfg.betas, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.verifier) == \
        (1e-6, (0.9, 0.95), 0.001, "low_var_kl", "math")
    assert (cfg.max_new_tokens, cfg.top_k, cfg.total_steps, cfg.precision, cfg.expected_world) == \
        (2048, 0, 500, "bf16", 16)
    assert cfg.records[0]["prompt_parts"] == ["What is 1 + 1?"]  # no prompt_type: the text as it is
    # an architecture the model file does not describe is named with the model file
    (hf / "config.json").write_text((hf / "config.json").read_text().replace('"num_hidden_layers": 28',
                                                                              '"num_hidden_layers": 24'))
    with pytest.raises(RLConfigError, match=r"model/qwen25_7b\.yaml: qwen25_7b\.num_layers: 28, but .*has 24"):
        msrl.parse_mindspeed_rl(tree, source=str(published), model_files=origin)


# ---------------------------------------------------------------------- templates, verifiers, YAML


def test_prompt_templates_lay_out_as_mindspeed_rl_s():
    user = [{"role": "user", "content": "2+2?"}]
    assert msrl.prompt_parts("qwen3", user) == ["<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"]
    assert msrl.prompt_parts("qwen", user) == ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
                                               "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"]
    assert msrl.prompt_parts("qwen", [{"role": "system", "content": "Be brief."}] + user)[0] == \
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert msrl.prompt_parts("llama2", [{"role": "system", "content": "S"}] + user) == \
        [msrl.BOS, "[INST] <<SYS>>\nS\n<</SYS>>\n\n2+2? [/INST]"]
    assert msrl.prompt_parts("alpaca", user) == [
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n", "### Instruction:\n2+2?\n\n### Response:\n"]
    turns = user + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}]
    assert msrl.prompt_parts("empty", turns) == ["2+2?", "4", "3+3?"]  # its assistant formatter has no EOS
    assert msrl.prompt_parts("default", turns) == ["Human: 2+2?\nAssistant:", "4", msrl.EOS, "\n",
                                                   "Human: 3+3?\nAssistant:"]
    assert msrl.prompt_parts(None, user) == ["2+2?"]


def test_tokenize_encodes_each_part_and_checks_the_prompt_budget():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    parts = msrl.prompt_parts("qwen3", [{"role": "user", "content": "What is 1 + 2?"}])
    cfg = rlconfig.RLConfig(model_path=str(TINY), records=[{"prompt_parts": parts, "ground_truth": "3"}],
                            max_prompt_length=64)
    msrl.tokenize(cfg, tok)
    assert cfg.records[0]["prompt_ids"] == tok.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    cfg.max_prompt_length = 5
    with pytest.raises(RLConfigError, match="prompt 0 has .* tokens, more than rl_config.max_prompt_length 5"):
        msrl.tokenize(cfg, tok)


def test_verifiers_score_as_mindspeed_rl_s():
    good = "<think>2 and 2</think> <answer>it is \\boxed{4}</answer>"
    assert msrl.base_acc("", good, "4") == 1.0
    assert msrl.base_acc("", good, "5") == 0.0
    assert msrl.base_acc("", "\\boxed{4}", "4") == 0.0  # the think / answer format is part of base_acc
    assert msrl.format_score("", "<think>x</think>\n<answer>y</answer>", "") == 1.0
    assert msrl.format_score("", "<answer>y</answer>", "") == 0.0
    assert msrl.strict_format("", good, "") == 1.0
    assert msrl.strict_format("", good + "<answer>", "") == -0.5
    assert msrl.strict_format("", "<think></think><answer>4</answer>", "") == -0.5  # no \boxed{}


def test_numbers_are_read_as_hydra_reads_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor_config:\n  lr: 1e-6\n  min_lr: 1.0e-7\n  save: 1e-6x\n")
    assert msrl.read_yaml(path)["actor_config"] == {"lr": 1e-6, "min_lr": 1e-7, "save": "1e-6x"}
    assert msrl.yaml_value("5e-4") == 5e-4 and msrl.yaml_value("[1.0]") == [1.0]


# ---------------------------------------------------------------------- through the engine's entry point


def test_bad_file_is_one_message_exit_2(msrl_dir, tmp_path):
    """`python -m backends.rl mindspeed_rl.yaml` (what launch.sh runs) with a misspelt key, then with a
    dataset row without labels: one message naming the key / the row, exit 2, no traceback."""
    for case, edit, want in (
            ("key", lambda t: t["rl_config"].update(n_samples_per_prompts=8),
             "rl_config.n_samples_per_prompts: not a MindSpeed-RL RLConfig key (did you mean n_samples_per_prompt?)"),
            ("row", None, "row 1: no 'labels' field")):
        run = tmp_path / case
        shutil.copytree(msrl_dir, run)
        tree = yaml.safe_load((run / "mindspeed_rl.yaml").read_text())
        if edit:
            edit(tree)
        else:
            data = run / "rows.jsonl"
            data.write_text('{"prompt": "What is 1 + 1?", "labels": "2"}\n{"prompt": "What is 2 + 2?"}\n')
            tree["megatron_training"]["data_path"] = str(data)
        (run / "mindspeed_rl.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
        env = dict(os.environ, AF_ENGINE_FILE=str(run / "engine.yaml"), AF_DEVICE="cpu", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "backends.rl", str(run / "mindspeed_rl.yaml")], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert want in proc.stderr and str(run / "mindspeed_rl.yaml") in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_run_refuses_what_the_dialect_does_not_build_before_launch():
    from backends.rl.capabilities import IMPLEMENTS, PENDING, unbuilt

    assert IMPLEMENTS["mindspeed-rl"] == {"methods:grpo": ["qwen2", "qwen3"], "vllm": ["qwen2", "qwen3"],
                                          "megatron_backend": ["qwen2", "qwen3"], "long_seq": ["qwen2", "qwen3"]}
    assert "methods" not in PENDING["mindspeed-rl"]
    assert unbuilt("mindspeed-rl", {"stage": "grpo", "rl.rollout.engine": "hf", "rl.reward.type": "gsm8k"}) == []
    assert any("DAPO runs with framework: verl" in w for w in unbuilt("mindspeed-rl", {"stage": "dapo"}))
    assert unbuilt("mindspeed-rl", {"rl.rollout.engine": "vllm"}) == []  # vLLM rollout is built (test_rl_vllm.py)
