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
    assert lay.pp_layers == [4, 4, 5, 5, 5, 5, 4, 4]
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
