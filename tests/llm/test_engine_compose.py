"""backends.llm: the parallel features composed with each other on 4 CPU processes against the one-process
run of the same job (rendered as `ascendfactory run` renders them, trained in one launch per world size:
tests/helpers/engine_runs.py); and the combinations this build still
refuses (capabilities.UNBUILT), refused by `run` before launching and by the engine at start.
"""

import shlex

import pytest
import torch
import yaml

from tests.llm.test_engine_expert_parallel import assert_ep_matches, ejob, metric, state_mib
from tests.llm.test_engine_pipeline import assert_pipeline_matches, pjob
from tests.helpers.tiny_hf import TINY
from tests.llm.test_engine_runs import job, losses, run_cli, torchrun


SHARDED_CP = {
    "fsdp2-over-dp2xcp2-ring-packed": ({"cp": 2, "cp_algo": "ring", "fsdp": True}, True),
    "distributed-optimizer-over-dp2xcp2-ulysses": ({"cp": 2, "cp_algo": "ulysses", "distributed_optimizer": True},
                                                   False),
}
EP_COMPOSED = {
    "ep2xfsdp2-packed": ("deepseek_v3", {"ep": 2, "fsdp": True}, True),
    "ep2xpp2-packed": ("mixtral", {"ep": 2, "pp": 2}, True),
    "ep2xpp2-distributed-optimizer": ("mixtral", {"ep": 2, "pp": 2, "distributed_optimizer": True}, False),
    "ep4-over-tp2-sp-xdp2": ("mixtral", {"ep": 4, "tp": 2, "sp": True}, False),
    "ep2-over-tp2-sp-xcp2-packed": ("deepseek_v3", {"ep": 2, "tp": 2, "sp": True, "cp": 2}, True),
}
LORA = {"finetuning": "lora", "lora": {"rank": 4, "alpha": 8, "merge_on_export": True}}
LORA_TP = {
    "glm4-tp2-sp-xdp2-packed": ("glm4", {"tp": 2, "sp": True}, True),
    "deepseek_v3-tp2xdp2": ("deepseek_v3", {"tp": 2, "moe_dispatcher": "alltoall_seq"}, False),
}


@pytest.fixture(scope="module")
def runs(engine_runs, one_process, tiny_model, tmp_path_factory):
    """Every run of this file and its one-process reference, added at once so that they train in one launch
    per world size (tests/helpers/engine_runs.py): name -> (a function giving the run dir, the reference's)."""
    tmp = tmp_path_factory.mktemp("engine-compose")
    pairs = {}

    def add(name, ref_spec, spec):
        ref = one_process.name(ref_spec)
        engine_runs.add(f"engine-compose/{name}", spec)
        pairs[name] = (lambda n=f"engine-compose/{name}": engine_runs[n], lambda r=ref: engine_runs[r])

    for name, (parallel, packed) in SHARDED_CP.items():
        data = {"packing": packed}
        add(name, job(tmp / "ref", data=data), job(tmp / name, data=data, parallel=parallel, **torchrun(4)))
    llama = tiny_model("llama", num_hidden_layers=4)
    add("fsdp-vpp-tied", pjob(tmp / "ref", llama, "llama", data={"packing": True}),
        pjob(tmp / "fsdp-vpp-tied", llama, "llama", data={"packing": True}, parallel={"pp": 2, "vpp": 2, "fsdp": True},
             **torchrun(4)))
    qwen = tiny_model("qwen3", num_hidden_layers=4)
    fp16 = {"precision": "fp16"}
    add("fp16-pp", pjob(tmp / "ref", qwen, train=fp16),
        pjob(tmp / "fp16-pp", qwen, train=fp16, parallel={"pp": 2}, **torchrun(4)))
    for name, (family, parallel, packed) in EP_COMPOSED.items():
        model, data = tiny_model(family), {"packing": packed}
        add(name, ejob(tmp / "ref", model, family, data=data),
            ejob(tmp / name, model, family, data=data, parallel=parallel, **torchrun(4)))
    for name, (family, parallel, packed) in LORA_TP.items():
        model = tiny_model(family)
        common = dict(model=TINY[family][1], model_path=str(model), data={"packing": packed}, train={"lr": 1e-2},
                      **LORA)
        ref_parallel = {k: v for k, v in parallel.items() if k == "moe_dispatcher"}
        add(name, job(tmp / "ref", parallel=ref_parallel, **common),
            job(tmp / name, parallel=parallel, **common, **torchrun(4)))
    mixtral = tiny_model("mixtral")
    add("lora-ep", ejob(tmp / "ref", mixtral, "mixtral", parallel={"moe_dispatcher": "alltoall_seq"}, **LORA),
        ejob(tmp / "lora-ep", mixtral, "mixtral", parallel={"ep": 2, "moe_dispatcher": "alltoall_seq"}, **LORA,
             **torchrun(4)))
    return pairs


def ran(runs, name):
    out, ref = runs[name]
    return out(), ref()


@pytest.mark.parametrize("name", list(SHARDED_CP))
def test_sharded_data_parallel_with_context_parallel(runs, name):
    """FSDP2 and the distributed optimizer shard over dp × cp (the cp ranks hold other tokens of the
    same samples, so their gradients are averaged with dp's): each rank holds a quarter of the state."""
    from tests.llm.test_engine_parallel import assert_matches

    out, ref = ran(runs, name)
    assert_matches(out, ref)
    assert metric(out, "grad_norm") == pytest.approx(metric(ref, "grad_norm"), rel=1e-5)
    weights_and_adam = state_mib(ref)[0]
    fsdp = SHARDED_CP[name][0].get("fsdp")
    assert max(state_mib(out)) <= (0.3 if fsdp else 0.55) * weights_and_adam, state_mib(out)


def test_fsdp2_with_interleaved_pipeline_and_tied_embeddings(runs):
    """pp2 × vpp2 × FSDP2 dp2 on a tied llama: each stage module is an FSDP2 root over its own layers
    (the last one's also holds the tied output copy, unsharded for the loss); the tied copies' grads
    are summed over the stages and the norm counts them once. A quarter of the model state per rank."""
    out, ref = ran(runs, "fsdp-vpp-tied")
    assert_pipeline_matches(out, ref)
    assert max(state_mib(out)) <= 0.3 * state_mib(ref)[0], (state_mib(out), state_mib(ref))


def test_fp16_loss_scaling_through_the_pipeline(runs):
    """pp2 × dp2 in fp16: the loss scale rides in the schedule's loss scaling, the stages unscale
    their own gradients and skip a step together (backends.common.trainer._agree_on_overflow): the
    same curve as one fp16 process, within 16-bit rounding."""
    out, ref = ran(runs, "fp16-pp")
    assert losses(out) == pytest.approx(losses(ref), rel=1e-3)
    assert metric(out, "grad_norm") == pytest.approx(metric(ref, "grad_norm"), rel=1e-3)
    assert losses(out)[-1] < losses(out)[0]


@pytest.mark.parametrize("name", list(EP_COMPOSED))
def test_expert_parallel_composes(runs, name):
    """FSDP2 shards the dense weights over dp and leaves the ep-sharded experts to grad_sync; inside
    pipeline stages the ep groups are carved from each stage's dp ranks (the all-to-alls run in the
    schedule's micro-batch order on every rank of a group) and the aux loss rides between stages.
    With tp (+ SP) the MoE layers route each tp rank's sequence shard over an ep group carved from
    dp·cp·tp (experts not tensor-sharded); the aux loss spans the cp × tp ranks of a micro-batch, with
    the CP padding mask cut to each shard."""
    assert_ep_matches(*ran(runs, name))


def assert_lora_matches(out, ref) -> None:
    """Losses and grad norms, the PEFT adapter and the merged export equal the one-process run's."""
    from safetensors.torch import load_file

    assert losses(out) == pytest.approx(losses(ref), rel=1e-5, abs=1e-6)
    assert metric(out, "grad_norm") == pytest.approx(metric(ref, "grad_norm"), rel=1e-5)
    for part in ("adapter/adapter_model.safetensors", "merged/model.safetensors"):
        want, got = load_file(ref / "hf" / part), load_file(out / "hf" / part)
        assert got.keys() == want.keys(), part
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(LORA_TP))
def test_lora_with_tensor_parallel(runs, name):
    """Adapters follow their base linear's layout: on column-parallel layers B is sharded (GLM-4's
    fused gate_up pair-interleaved like its base), on row-parallel ones A is, reduced on its r-wide
    output; MLA's replicated latents and DeepSeek's shared experts (reduced with the MoE block) too."""
    assert_lora_matches(*ran(runs, name))


def test_lora_on_moe_with_expert_parallel(runs, tiny_model):
    """Mixtral LoRA (attention adapters; routed experts frozen, ep-sharded) at dp4 × ep2: the adapters
    and the merged export equal the one-process run's, and so do the losses and grad norms."""
    from safetensors.torch import load_file

    out, ref = ran(runs, "lora-ep")
    assert_lora_matches(out, ref)
    assert metric(out, "aux_loss") == pytest.approx(metric(ref, "aux_loss"), rel=1e-5)
    first = load_file(tiny_model("mixtral") / "model.safetensors")
    merged = load_file(out / "hf" / "merged" / "model.safetensors")
    assert any((merged[k] - first[k]).abs().max() > 1e-4 for k in first if "self_attn" in k)  # it trained


# ---------------------------------------------------------------------- what this build refuses

REFUSED = {  # capabilities.UNBUILT entry (its fields) → a job that triggers it (family, job changes, devices)
    ("parallel.ep", "parallel.tp", "parallel.sp"): ("mixtral", {"parallel": {"ep": 2, "tp": 2}}, 2),
    ("parallel.ep", "parallel.moe_dispatcher"): ("mixtral", {"parallel": {"ep": 2, "moe_dispatcher": "allgather"}}, 2),
}


def test_every_refused_combination_has_a_case():
    from backends.llm.capabilities import UNBUILT

    assert {tuple(conditions) for conditions, _ in UNBUILT["mindspeed-llm"]} == set(REFUSED)


@pytest.mark.parametrize("fields", list(REFUSED), ids=["+".join(f.split(".")[-1] for f in k) for k in REFUSED])
def test_refused_combination_stops_run_and_engine(tmp_path, tiny_model, fields):
    """`run` exits 2 before launching anything, naming the job fields; the engine started by hand with
    the rendered flags refuses with the same words (one table: capabilities.UNBUILT)."""
    from ascendfactory.job_file import parse_job
    from ascendfactory.plan import make_plan
    from ascendfactory.render import render
    from backends.llm.capabilities import UNBUILT
    from backends.llm.config import ConfigError, parse_args
    from backends.llm.recipe import refuse_unbuilt_parallelism

    family, changes, devices = REFUSED[fields]
    why = next(w for conditions, w in UNBUILT["mindspeed-llm"] if tuple(conditions) == fields)
    model = tiny_model(family)
    spec = job(tmp_path / "out", model=TINY[family][1], model_path=str(model), **torchrun(devices))
    for key, value in changes.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    res = run_cli("run", path)
    said = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 2, said
    assert why in said and all(f in said for f in fields) and "Traceback" not in said, said
    assert not (tmp_path / "out" / "logs").exists()  # nothing was launched
    plan = make_plan(parse_job(yaml.safe_dump(spec)), check_memory=False)
    files = render(plan, tmp_path / "render").files
    args = shlex.split(files["mindspeed_llm_args.sh"], comments=True)
    with pytest.raises(ConfigError) as err:
        refuse_unbuilt_parallelism(parse_args(args, engine=yaml.safe_load(files["engine.yaml"])))
    assert why in str(err.value) and all(f in str(err.value) for f in fields)
