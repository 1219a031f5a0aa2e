"""The MindSpeed-LLM flag dialect: what the template renders, the engine parses."""

import shlex
from pathlib import Path

import pytest

from ascendfactory.plan import make_plan
from ascendfactory.render import render
from ascendfactory.spec import load_job, parse_job
from backends.llm.config import ConfigError, parse_args

ROOT = Path(__file__).resolve().parents[2]
LLM_EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if load_job(p).framework == "mindspeed-llm"]


def _engine_args(plan, tmp_path):
    r = render(plan, tmp_path / "run")
    return shlex.split(r.files["mindspeed_llm_args.sh"], comments=True)


@pytest.mark.parametrize("path", LLM_EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_example_parses(path, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = make_plan(load_job(path), check_memory=False)
    cfg = parse_args(_engine_args(plan, tmp_path))
    job = plan.job
    assert cfg.parallel.tp == job.parallel.tp and cfg.parallel.pp == job.parallel.pp
    assert cfg.parallel.cp == job.parallel.cp and cfg.parallel.ep == job.parallel.ep
    assert cfg.data.seq_len == job.data.seq_len and cfg.data.packing == job.data.packing
    assert cfg.train.global_batch == job.train.global_batch and cfg.train.lr == job.train.lr
    assert (cfg.lora is not None) == (job.finetuning == "lora")
    assert cfg.train.precision == job.train.precision


def test_every_job_setting_reaches_the_engine(job_text, tmp_path):
    job = parse_job(job_text(model="mixtral-8x7b-instruct-v0.1", finetuning="lora",
                             lora={"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "merge_on_export": True},
                             parallel={"moe_dispatcher": "alltoall_seq", "recompute": "selective", "fsdp": True},
                             data={"dynamic_seq_len": True, "pad_to_multiple_of": 16, "max_samples": 10,
                                   "shuffle": False, "template": "qwen3"},
                             train={"steps": 7, "warmup_steps": 2, "schedule": "linear", "min_lr": 1e-6,
                                    "weight_decay": 0.01, "grad_clip": 0.5, "precision": "bf16", "seed": 3,
                                    "moe_aux_loss_coeff": 0.01, "save_interval": 3},
                             kernels={"backend": "reference", "overrides": {"attention": "reference"}}))
    cfg = parse_args(_engine_args(make_plan(job, check_memory=False), tmp_path))
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 8 and cfg.lora.targets == ["q_proj", "v_proj"]
    assert cfg.lora.merge_on_export and cfg.parallel.moe_dispatcher == "alltoall_seq"
    assert cfg.parallel.recompute == "selective" and cfg.parallel.fsdp
    assert cfg.data.dynamic and cfg.data.pad_to_multiple_of == 16 and cfg.data.max_samples == 10
    assert not cfg.data.shuffle and cfg.data.template == "qwen3"
    t = cfg.train
    assert (t.steps, t.warmup, t.schedule, t.min_lr, t.weight_decay, t.grad_clip, t.precision, t.seed) == \
        (7, 2, "linear", 1e-6, 0.01, 0.5, "bf16", 3)
    assert t.moe_aux_loss_coeff == 0.01 and t.save_interval == 3
    assert cfg.kernel_backend == "reference" and cfg.kernel_overrides == {"attention": "reference"}
    assert cfg.model.overrides["moe"]["num_experts"] == 8 and cfg.model.overrides["moe"]["experts_per_token"] == 2


def test_unknown_flag_names_the_closest_and_lists_the_supported():
    base = ["--model-id", "qwen3-8b", "--data-path", "x", "--seq-length", "8", "--global-batch-size", "1",
            "--lr", "1e-4", "--train-iters", "1"]
    with pytest.raises(ConfigError) as err:
        parse_args(base + ["--tensor-parallel-size", "2"])
    assert "did you mean --tensor-model-parallel-size" in str(err.value) and "--seq-length" in str(err.value)
    with pytest.raises(ConfigError, match="--train-iters or --train-epochs"):
        parse_args(base[:-2])
    with pytest.raises(ConfigError, match="--load-hf"):
        parse_args(base[2:])


def test_recompute_method_and_num_layers_are_honoured_or_refused():
    """--recompute-method / --recompute-num-layers reach the model (Megatron's uniform / block), and
    with selective granularity they are refused instead of ignored."""
    from backends.common.parallel.data_parallel import single_process
    from backends.common.parallel.recompute import Recomputed
    from backends.llm import models, parallelize
    from tests.helpers.tiny_hf import _COMMON, TINY

    base = ["--model-id", "qwen3-8b", "--data-path", "d", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--lr", "1e-3", "--train-iters", "1"]
    cfg = models.ModelConfig.from_hf({"model_type": "qwen3", **_COMMON, **TINY["qwen3"][2], "num_hidden_layers": 4})

    def checkpointed(flags):
        decoder = models.build_model(cfg)
        p = parse_args(base + flags).parallel
        parallelize._recompute(decoder, p, single_process(None))
        return [isinstance(layer.__dict__.get("forward"), Recomputed) for layer in decoder.model.layers]

    assert checkpointed(["--recompute-granularity", "full", "--recompute-method", "block",
                         "--recompute-num-layers", "3"]) == [True, True, True, False]
    assert checkpointed(["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "2"]) == [True, False, True, False]
    with pytest.raises(ConfigError, match="--recompute-granularity full only"):
        checkpointed(["--recompute-granularity", "selective", "--recompute-method", "block"])
