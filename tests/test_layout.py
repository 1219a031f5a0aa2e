"""Every layout rule, accepted and refused, each refusal naming the field and the fix."""

import pytest

from ascendfactory.errors import JobError


def refusal(plan_of, **changes):
    with pytest.raises(JobError) as info:
        plan_of(**changes)
    return info.value.render()


def test_data_parallel_is_world_over_model_parallel(plan_of):
    lay = plan_of(parallel={"tp": 2, "pp": 2}).layout
    assert (lay.world, lay.dp, lay.grad_accum) == (8, 2, 8)
    text = refusal(plan_of, parallel={"tp": 3})
    assert "world / (tp·pp·cp) = 8 / 3" in text and "parallel" in text


def test_multi_node_world(plan_of):
    lay = plan_of(resources={"nnodes": 2, "devices_per_node": 8}, parallel={"tp": 4}).layout
    assert lay.world == 16 and lay.dp == 4


def test_heads_must_split_over_tp(plan_of):
    # qwen3-8b: 32 heads, 8 kv heads
    assert plan_of(parallel={"tp": 8}).layout.tp == 8
    text = refusal(plan_of, parallel={"tp": 3}, resources={"devices_per_node": 3})
    assert "32 attention heads do not split over tp=3" in text


def test_kv_heads_vs_tp(plan_of):
    # glm-4-9b-chat has 2 KV heads: tp 4 replicates them, tp 3 cannot
    plan_of(model="glm-4-9b-chat", parallel={"tp": 4})
    text = refusal(plan_of, model="glm-4-9b-chat", parallel={"tp": 8}, resources={"devices_per_node": 8},
                   model_overrides={"num_kv_heads": 3})
    assert "KV heads" in text


def test_layers_split_over_pp_or_explicit_list(plan_of):
    plan_of(parallel={"pp": 4})  # 36 layers
    text = refusal(plan_of, parallel={"pp": 8})
    assert "36 layers do not split evenly over pp=8" in text and "pp_layers" in text
    lay = plan_of(parallel={"pp": 8, "pp_layers": [4, 4, 5, 5, 5, 5, 4, 4]}).layout
    assert lay.pp_layers == (4, 4, 5, 5, 5, 5, 4, 4)
    assert "summing to 36" in refusal(plan_of, parallel={"pp": 2, "pp_layers": [10, 10]})


def test_virtual_pipeline(plan_of):
    plan_of(parallel={"pp": 2, "vpp": 2}, train={"global_batch": 16, "micro_batch": 1})
    assert "need pipeline parallel" in refusal(plan_of, parallel={"vpp": 2})
    assert "split into vpp=5" in refusal(plan_of, parallel={"pp": 2, "vpp": 5})
    text = refusal(plan_of, parallel={"pp": 2, "vpp": 2}, train={"global_batch": 12, "micro_batch": 1})
    assert "multiple of pp=2" in text


def test_experts_split_over_ep_and_ep_divides_dp_cp_tp(plan_of):
    plan_of(model="qwen3-30b-a3b", parallel={"ep": 8})       # 128 experts, dp 8
    assert "has no experts" in refusal(plan_of, parallel={"ep": 2})
    text = refusal(plan_of, model="mixtral-8x7b-instruct-v0.1", parallel={"ep": 3},
                   resources={"devices_per_node": 6}, train={"global_batch": 12})
    assert "8 experts do not split over ep=3" in text
    text = refusal(plan_of, model="qwen3-30b-a3b", parallel={"ep": 16})
    assert "must divide dp·cp·tp" in text


def test_ring_context_parallel(plan_of):
    plan_of(parallel={"cp": 4, "cp_algo": "ring"}, data={"seq_len": 8192})
    assert "divisible by 2·cp = 8" in refusal(plan_of, parallel={"cp": 4, "cp_algo": "ring"},
                                               data={"seq_len": 4100})


def test_ulysses_context_parallel(plan_of):
    plan_of(parallel={"cp": 4, "cp_algo": "ulysses", "tp": 2}, data={"seq_len": 8192})
    assert "divisible by cp = 4" in refusal(plan_of, parallel={"cp": 4, "cp_algo": "ulysses"},
                                             data={"seq_len": 4098})
    # 40 heads (qwen3-14b) over cp 16 · tp 1 do not divide
    text = refusal(plan_of, model="qwen3-14b", parallel={"cp": 16, "cp_algo": "ulysses"}, data={"seq_len": 8192},
                   resources={"devices_per_node": 16})
    assert "heads (40) divisible by cp·tp = 16" in text


def test_hybrid_context_parallel(plan_of):
    lay = plan_of(parallel={"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}, data={"seq_len": 8192}).layout
    assert (lay.ulysses_degree, lay.ring_degree) == (2, 2)
    assert "needs the Ulysses degree" in refusal(plan_of, parallel={"cp": 4, "cp_algo": "hybrid"})
    assert "above 1" in refusal(plan_of, parallel={"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 4})
    assert "only used with cp_algo: hybrid" in refusal(plan_of, parallel={"cp": 2, "ulysses_degree": 2})
    text = refusal(plan_of, parallel={"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}, data={"seq_len": 4100})
    assert "2·cp = 8" in text


def test_context_parallel_needs_flash_attention(plan_of):
    text = refusal(plan_of, parallel={"cp": 2}, kernels={"flash_attention": False})
    assert "kernels.flash_attention" in text and "never switched on silently" in text


def test_global_batch_multiple_of_micro_times_dp(plan_of):
    lay = plan_of(train={"global_batch": 32, "micro_batch": 2}).layout
    assert lay.grad_accum == 2
    text = refusal(plan_of, train={"global_batch": 20, "micro_batch": 2})
    assert "not a multiple of micro_batch × dp = 2 × 8 = 16" in text and "32" in text


def test_sequence_parallel_needs_tp(plan_of):
    assert "sequence parallel" in refusal(plan_of, parallel={"sp": True})
    assert plan_of(parallel={"sp": True, "tp": 2}).layout.sp


def test_lora_on_moe_needs_alltoall_seq(plan_of):
    text = refusal(plan_of, model="mixtral-8x7b-instruct-v0.1", finetuning="lora")
    assert "alltoall_seq" in text
    plan_of(model="mixtral-8x7b-instruct-v0.1", finetuning="lora", parallel={"moe_dispatcher": "alltoall_seq"})


def test_neat_packing_needs_packing(plan_of):
    assert "needs packing" in refusal(plan_of, data={"neat_packing": True})
    plan_of(data={"neat_packing": True, "packing": True})
    assert "not both" in refusal(plan_of, data={"packing": True, "dynamic_seq_len": True})


def test_one_sharding_scheme(plan_of):
    assert "keep one" in refusal(plan_of, framework="llamafactory", parallel={"zero": 2, "fsdp": True})


def test_local_launcher_is_single_process(plan_of):
    assert "local launcher" in refusal(plan_of, launcher="local")
    plan_of(launcher="local", resources={"devices_per_node": 1}, train={"global_batch": 4})


def test_rl_mini_batch_divides_global_batch(plan_of):
    text = refusal(plan_of, model="qwen3-14b", framework="verl", stage="grpo",
                   rl={"mini_batch": 5, "engine": "vllm"}, parallel={"fsdp": True})
    assert "rl.mini_batch" in text


def test_every_refusal_reported_at_once(plan_of):
    with pytest.raises(JobError) as info:
        plan_of(parallel={"tp": 3, "pp": 5, "sp": False, "vpp": 2})
    assert len(info.value.problems) >= 3


# ---------------------------------------------------------------------- backends.contract.layout itself

from backends.contract import layout as lay  # noqa: E402
from tests.helpers.megatron_flags import ARCH  # noqa: E402

QWEN3_8B = {"heads": 32, "kv_heads": 8, "layers": 36}


def test_solve_returns_the_frozen_layout():
    got = lay.check(world=16, nnodes=2, tp=2, pp=2, cp=2, **QWEN3_8B, seq_len=4096, micro_batch=1, global_batch=8)
    assert (got.world, got.nnodes, got.devices_per_node, got.dp, got.grad_accum) == (16, 2, 8, 2, 4)
    assert got.pp_layers == (18, 18) and got.ring_degree == 2 and got.mesh_shape == (2, 2, 2, 2)
    with pytest.raises(AttributeError):
        got.tp = 4  # frozen: what the planner put in the plan is what the engine builds


def test_every_broken_rule_comes_back_at_once_with_its_field():
    layout, problems = lay.solve(world=8, tp=3, pp=5, vpp=2, sp=False, ep=2, cp=2, cp_algo="ulysses",
                                 ulysses_degree=2, **QWEN3_8B, seq_len=4097, micro_batch=3, global_batch=5)
    assert layout is None
    fields = [p.field for p in problems]
    assert {"parallel", "parallel.tp", "parallel.pp", "parallel.vpp", "parallel.ep", "parallel.ulysses_degree",
            "data.seq_len", "parallel.cp"} <= set(fields)
    assert all(p.message and p.hint for p in problems)
    with pytest.raises(lay.LayoutError) as err:
        lay.check(world=8, tp=3, **QWEN3_8B)
    assert len(err.value.problems) == 3 and "parallel.tp: 32 attention heads" in str(err.value)


def test_rules_without_their_inputs_are_not_checked():
    # the engine may not know a batch or a sequence length; nothing is guessed for them
    got = lay.check(world=4, cp=4, **QWEN3_8B)
    assert got.grad_accum == 0 and got.ring_degree == 4
    assert not lay.solve(world=4, cp=4, **QWEN3_8B, seq_len=4100)[0]


def test_layers_per_virtual_stage_is_the_same_rule_as_vpp():
    a = lay.check(world=4, pp=2, vpp=3, **QWEN3_8B)
    b = lay.check(world=4, pp=2, vpp_layers=6, **QWEN3_8B)
    assert a == b and a.vpp == 3
    assert "layers per virtual stage" in str(lay.solve(world=4, pp=2, vpp_layers=7, **QWEN3_8B)[1][0])
    # Megatron cuts equal chunks only: an explicit per-stage list and vpp do not combine
    text = str(lay.solve(world=2, pp=2, vpp=2, pp_layers=[18, 18], **QWEN3_8B)[1])
    assert "do not combine" in text


def test_expert_group_is_carved_from_dp_cp_tp():
    assert lay.check(world=8, tp=2, ep=8, heads=32, kv_heads=4, layers=48, experts=128).ep == 8
    problems = lay.solve(world=8, pp=2, ep=8, heads=32, kv_heads=4, layers=48, experts=128)[1]
    assert [p.field for p in problems] == ["parallel.ep"] and "dp·cp·tp = 4·1·1 = 4" in problems[0].message
    assert "has no experts" in lay.solve(world=2, ep=2, **QWEN3_8B)[1][0].message


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16])
def test_property_every_accepted_layout_is_consistent(world):
    """Over a grid of layouts: an accepted one multiplies out to the world, divides the model, and
    its batch adds up; a refused one names at least one rule."""
    import itertools

    model = {"heads": 16, "kv_heads": 4, "layers": 12, "experts": 8}
    for tp, pp, cp, ep, algo in itertools.product((1, 2, 4), (1, 2, 3), (1, 2), (1, 2, 4), ("ring", "ulysses")):
        layout, problems = lay.solve(world=world, tp=tp, pp=pp, cp=cp, ep=ep, cp_algo=algo, **model, seq_len=256,
                                     micro_batch=1, global_batch=24)
        assert (layout is None) == bool(problems)
        if layout is None:
            continue
        assert layout.dp * tp * pp * cp == world and model["heads"] % tp == 0
        assert sum(layout.pp_layers) == model["layers"] and len(layout.pp_layers) == pp
        assert (layout.dp * cp * tp) % ep == 0 and model["experts"] % ep == 0
        assert layout.grad_accum * layout.micro_batch * layout.dp == layout.global_batch
        assert layout.ulysses_degree * layout.ring_degree == cp


def test_even_split_puts_the_remainder_on_the_last_stages():
    assert lay.even_split(10, 4) == [2, 2, 3, 3] and lay.even_split(8, 4) == [2, 2, 2, 2]


# ---------------------------------------------------------------------- planner and engine agree

AGREEMENT = [  # (model, world, parallel, seq_len, micro, global)
    ("qwen3-8b", 8, {"tp": 2, "pp": 2}, 4096, 1, 16),
    ("qwen3-8b", 8, {"tp": 3}, 4096, 1, 16),                         # world and heads
    ("qwen3-8b", 4, {"pp": 2, "vpp": 3}, 4096, 1, 8),                 # interleaved pp, 4 micro-batches
    ("qwen3-8b", 4, {"pp": 2, "vpp": 2}, 4096, 1, 6),                 # 3 micro-batches over pp 2
    ("qwen3-8b", 2, {"pp": 2, "pp_layers": [10, 26]}, 4096, 1, 2),
    ("qwen3-8b", 2, {"pp": 2, "pp_layers": [10, 20]}, 4096, 1, 2),    # list does not sum to the layers
    ("qwen3-8b", 8, {"pp": 8}, 4096, 1, 8),                           # 36 layers over pp 8
    ("qwen3-8b", 4, {"cp": 4, "cp_algo": "ring"}, 4100, 1, 4),        # ring needs seq % 2cp
    ("qwen3-8b", 4, {"cp": 4, "cp_algo": "ulysses"}, 4096, 1, 4),
    ("qwen3-8b", 8, {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}, 8192, 1, 8),
    ("qwen3-8b", 4, {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 4}, 8192, 1, 4),  # one ring group
    ("qwen3-8b", 4, {"tp": 2, "sp": True}, 4096, 1, 4),
    ("qwen3-8b", 8, {}, 4096, 3, 16),                                 # batch not a multiple of micro × dp
    ("mixtral-8x7b-instruct-v0.1", 8, {"ep": 4}, 4096, 1, 8),
    ("mixtral-8x7b-instruct-v0.1", 6, {"ep": 3}, 4096, 1, 6),         # 8 experts over ep 3
    ("mixtral-8x7b-instruct-v0.1", 8, {"pp": 4, "ep": 4}, 4096, 1, 8),  # ep 4 over dp·cp·tp 2
]


def _engine_flags(arch, world, par, seq, micro, global_batch):
    """The numbers in MindSpeed-LLM's flags, as the engine reads them."""
    algo = {"ring": "megatron_cp_algo", "ulysses": "ulysses_cp_algo", "hybrid": "hybrid_cp_algo"}
    flags = [*ARCH, "--data-path", "x", "--lr", "1e-4", "--train-iters", "1",
             "--seq-length", str(seq), "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
             "--tensor-model-parallel-size", str(par.get("tp", 1)), "--pipeline-model-parallel-size",
             str(par.get("pp", 1)), "--context-parallel-size", str(par.get("cp", 1)),
             "--context-parallel-algo", algo[par.get("cp_algo", "ring")], "--expert-model-parallel-size",
             str(par.get("ep", 1))]
    if par.get("pp_layers"):
        flags += ["--num-layer-list", ",".join(map(str, par["pp_layers"]))]
    if par.get("vpp", 1) > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(arch["num_layers"] // par["pp"] // par["vpp"])]
    if par.get("sp"):
        flags.append("--sequence-parallel")
    if par.get("ulysses_degree"):
        flags += ["--ulysses-degree-in-cp", str(par["ulysses_degree"])]
    return flags


class _MeshReached(Exception):
    """The engine accepted the layout and went on to build its mesh."""


def _engine_verdict(monkeypatch, arch, world, par, seq, micro, global_batch):
    from types import SimpleNamespace

    from backends.common.parallel import mesh
    from backends.llm import parallelize
    from backends.llm.config import ConfigError, parse_args

    def reached(layout, device_type):
        raise _MeshReached

    monkeypatch.setattr(mesh, "build_mesh", reached)  # what backends.common.kit.on_mesh calls
    cfg = parse_args(_engine_flags(arch, world, par, seq, micro, global_batch), engine={"model_id": "qwen3-8b"})
    moe = SimpleNamespace(num_experts=arch["moe"]["num_experts"]) if arch.get("moe") else None
    config = SimpleNamespace(num_attention_heads=arch["num_attention_heads"], num_kv_heads=arch["num_kv_heads"],
                             num_layers=arch["num_layers"], moe=moe, mla=None)
    rt = SimpleNamespace(world=world, device=SimpleNamespace(type="cpu"))
    try:
        parallelize.setup(cfg, SimpleNamespace(config=config), rt)
    except _MeshReached:
        return None
    except ConfigError as err:
        return str(err)
    return None  # one process: no mesh to build


@pytest.mark.parametrize("model,world,par,seq,micro,global_batch", AGREEMENT)
def test_planner_and_engine_give_the_same_verdict(plan_of, monkeypatch, model, world, par, seq, micro, global_batch):
    pytest.importorskip("torch")
    from ascendfactory import catalog

    try:
        plan_of(model=model, parallel=par, data={"seq_len": seq}, resources={"devices_per_node": world},
                train={"micro_batch": micro, "global_batch": global_batch})
        planner = []
    except JobError as err:
        planner = err.problems
    engine = _engine_verdict(monkeypatch, catalog.models()[model]["arch"], world, par, seq, micro, global_batch)
    assert (engine is None) == (not planner), (planner, engine)
    for problem in planner:  # the same rule, in the same words
        assert f"{problem.where}: {problem.message}" in engine


# ---------------------------------------------------------------------- RL roles: each its own layout

def test_each_rl_role_layout_is_checked_on_the_same_devices(plan_of):
    # qwen2.5-7b's cell lists grpo only: ppo (for its critic) passes the ❌ cell with a warning
    base = dict(model="qwen2.5-7b", framework="mindspeed-rl", stage="ppo", parallel={"tp": 4},
                data={"format": "prompt", "seq_len": 1024}, allow_unsupported=True)
    plan = plan_of(**base, rl={"critic": {"parallel": {"tp": 2, "pp": 2}}, "rollout": {"parallel": {"tp": 2}}})
    roles = plan.roles
    assert (roles["actor"].tp, roles["actor"].dp) == (4, 2) and (roles["critic"].tp, roles["critic"].pp) == (2, 2)
    assert roles["rollout"].tp == 2 and roles["reference"].mesh_shape == roles["actor"].mesh_shape == (1, 2, 1, 4)
    assert plan.effective_config()["resolved"]["role_layouts"]["critic"]["dp"] == 2
    text = refusal(plan_of, **base, rl={"actor": {"parallel": {"tp": 3}}, "reference": {"parallel": {"cp": 2, "tp": 4}}})
    assert "rl.actor.parallel.tp: the actor's layout: 28 attention heads do not split over tp=3" in text
    assert "data.seq_len" not in text and "rl.reference" not in text  # ring cp 2: 1024 splits; 28 heads / tp 4
    # a reference without a layout of its own follows the actor's: its problems are the actor's, said once
    text = refusal(plan_of, **base, rl={"actor": {"parallel": {"tp": 3}}})
    assert "rl.actor.parallel.tp" in text and "rl.reference" not in text
    # a role that keeps the job's layout reports its problems once, as the job's
    text = refusal(plan_of, **{**base, "parallel": {"tp": 3}})
    assert text.count("28 attention heads do not split over tp=3") == 1


def test_reward_model_layout_uses_its_own_architecture(plan_of):
    base = dict(model="qwen3-14b", framework="verl", stage="grpo", parallel={"fsdp": True},
                data={"format": "prompt", "seq_len": 1024})
    reward = {"type": "model", "model_path": "examples/tiny-qwen3"}  # 4 heads, 2 KV heads, 2 layers
    assert plan_of(**base, rl={"reward": {**reward, "parallel": {"tp": 2}}}).roles["reward"].tp == 2
    text = refusal(plan_of, **base, rl={"reward": {**reward, "parallel": {"tp": 8}}})
    assert "rl.reward.parallel.tp: the reward's layout: 4 attention heads do not split over tp=8" in text
    text = refusal(plan_of, **base, rl={"reward": {"type": "model", "model_path": "no/such/dir"}})
    assert "rl.reward.model_path" in text


def test_verl_roles_train_with_fsdp_and_roll_out_with_tp(plan_of):
    base = dict(model="qwen3-14b", framework="verl", stage="grpo", parallel={"fsdp": True},
                data={"format": "prompt", "seq_len": 1024})
    assert plan_of(**base, rl={"rollout": {"parallel": {"tp": 4}}}).roles["rollout"].tp == 4
    text = refusal(plan_of, **base, rl={"actor": {"parallel": {"tp": 2}}})
    assert "rl.actor.parallel" in text and "FSDP backend" in text
    text = refusal(plan_of, **base, rl={"reference": {"parallel": {"cp": 2, "cp_algo": "ring"}}})
    assert "rl.reference.parallel.cp_algo" in text and "Ulysses" in text


def test_pipeline_needs_a_micro_batch_per_stage(plan_of):
    """A layout that plans also starts: torch's 1F1B refuses fewer micro-batches than stages."""
    text = refusal(plan_of, parallel={"pp": 4}, resources={"devices_per_node": 4},
                   train={"global_batch": 2, "micro_batch": 1})
    assert "train.global_batch" in text and "at least pp=4 micro-batches" in text and "at least 4" in text
    assert plan_of(parallel={"pp": 4}, resources={"devices_per_node": 4},
                   train={"global_batch": 4, "micro_batch": 1}).layout.grad_accum == 4
