"""Context-parallel RL actors (the MindSpeed-RL dialect's long-sequence column): the example job
examples/mindspeed-rl/grpo.yaml, rendered, with actor_config.context_parallel_size 2 on 2 processes, ring
(megatron_cp_algo) and Ulysses (ulysses_cp_algo), and cp 2 x tp 2 (ring) and cp 2 x dp 2 (Ulysses) on 4, equals the 1-process run
over 3 steps: losses, rewards, grad norms, KL / clip / entropy metrics and the trained weights within 1e-5.
Rollout runs the whole sequence on every cp rank; the old / reference / current log-probs run the
sequences sharded over the cp ranks (head / tail chunks, global positions), attention through ring or
Ulysses, and the cp ranks' partial gradients are summed (backends/rl/context_parallel.py)."""

from pathlib import Path

import pytest
import yaml

from tests.helpers.rl_runs import ROOT, Launches, assert_same_training, steps
from tests.rl.test_mindspeed_rl_engine import parse, refused, rendered
from tests.rl.test_rl_tensor_parallel import KEYS

# processes: [(case, actor tp, actor cp, context_parallel_algo)]; one launch per world
LAUNCHES = {1: [("cp1", 1, 1, None)], 2: [("cp2_ring", 1, 2, "megatron_cp_algo"), ("cp2_ulysses", 1, 2, "ulysses_cp_algo")],
            4: [("cp2tp2", 2, 2, "megatron_cp_algo"), ("cp2dp2", 1, 2, "ulysses_cp_algo")]}


def _job(run_dir: Path, name: str, tp: int, cp: int, algo: str | None, world: int) -> Path:
    """The rendered MindSpeed-RL file at actor tp / cp (the reference the integrated worker's), 3 steps."""
    tree = yaml.safe_load((run_dir / "mindspeed_rl.yaml").read_text())
    tree["actor_config"].update(tensor_model_parallel_size=tp, context_parallel_size=cp, train_iters=3)
    if algo:
        tree["actor_config"]["context_parallel_algo"] = algo
    tree["rl_config"]["actor_resource"]["num_npus"] = world
    out = run_dir / f"mindspeed_rl_{name}.yaml"
    out.write_text(yaml.safe_dump(tree, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_cp")
    job = rendered("examples/mindspeed-rl/grpo.yaml", tmp / "job")
    return Launches("_rl_run_worker.py", tmp, {
        world: [{"name": n, "file": str(_job(job, n, tp, cp, algo, world))} for n, tp, cp, algo in cases]
        for world, cases in LAUNCHES.items()})


@pytest.mark.parametrize("name", ["cp2_ring", "cp2_ulysses", "cp2tp2", "cp2dp2"])
def test_context_parallel_matches_one_process(runs, name):
    assert_same_training((runs["cp1"], "cp1"), (runs[name], name), KEYS)
    # the run does something: the policy moves, the samples differ, the KL term is live
    one = steps(runs["cp1"], "cp1")
    assert all(r["grad_norm"] > 0 for r in one) and len({r["reward_mean"] for r in one}) > 1
    assert any(abs(r["actor/kl_loss"]) > 0 for r in one[1:])


# ---------------------------------------------------------------------- the rendered file and refusals


def _msrl_job(parallel: dict, world: int):
    from ascendfactory.job_file import parse_job

    spec = yaml.safe_load((ROOT / "examples" / "mindspeed-rl" / "grpo.yaml").read_text())
    spec.update(parallel=parallel, launcher="torchrun", resources={"device": "cpu", "devices_per_node": world})
    return parse_job(yaml.safe_dump(spec))


@pytest.mark.parametrize("algo,key,engine", [("ring", "megatron_cp_algo", "ring"),
                                             ("ulysses", "ulysses_cp_algo", "ulysses")])
def test_a_job_at_cp_2_renders_the_keys_and_the_engine_reads_them(tmp_path, monkeypatch, algo, key, engine):
    """parallel.cp 2 on the mindspeed-rl framework: `run`'s checks pass (LIMITS parallel.cp, the long_seq
    cell), actor_config carries context_parallel_size 2 and context_parallel_algo, and the engine parses
    the file to cp 2 with that algorithm."""
    from ascendfactory.engines import require_ready
    from ascendfactory.frameworks.mindspeed_rl import ADAPTER
    from ascendfactory.plan import make_plan
    from ascendfactory.render import render, write_files

    monkeypatch.chdir(ROOT)
    job = _msrl_job({"cp": 2, "cp_algo": algo}, 2)
    require_ready(job)  # `run`'s check before launch: raises on a parallel.cp over the engine's LIMITS
    assert "long_seq" in [use.feature for use in ADAPTER.features_used(job, True)]
    write_files(render(make_plan(job, check_memory=False), tmp_path), tmp_path)
    tree = yaml.safe_load((tmp_path / "mindspeed_rl.yaml").read_text())
    assert tree["actor_config"]["context_parallel_size"] == 2
    assert tree["actor_config"]["context_parallel_algo"] == key
    assert tree["rl_config"]["actor_resource"]["num_npus"] == 2
    cfg = parse(tmp_path)
    assert (cfg.cp, cfg.cp_algo, cfg.tp, cfg.expected_world) == (2, engine, 1, 2)


def test_context_parallel_refusals_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rendered("examples/mindspeed-rl/grpo.yaml", tmp_path)

    def actor(npus=2, tp=1, **keys):
        return lambda t: (t["actor_config"].update(tensor_model_parallel_size=tp, **keys),
                          t["rl_config"]["actor_resource"].update(num_npus=npus))
    assert parse(tmp_path, actor(context_parallel_size=2, context_parallel_algo="megatron_cp_algo")).cp == 2
    assert "rl_config.actor_resource.num_npus: 3 is not a multiple of actor_config.tensor_model_parallel_size 1 x " \
        "actor_config.context_parallel_size 2" in refused(tmp_path, actor(3, context_parallel_size=2))
    assert "num_npus: 4 is not a multiple of actor_config.tensor_model_parallel_size 2 x " \
        "actor_config.context_parallel_size 4" in refused(tmp_path, actor(4, 2, context_parallel_size=4))
    text = refused(tmp_path, actor(context_parallel_size=2, context_parallel_algo="ring"))
    assert "actor_config.context_parallel_algo: 'ring': not a context-parallel algorithm" in text
    assert "megatron_cp_algo or ulysses_cp_algo" in text
    text = refused(tmp_path, actor(context_parallel_size=2, context_parallel_algo="hybrid_cp_algo"))
    assert "actor_config.context_parallel_algo: hybrid_cp_algo needs a Ulysses degree" in text
    # the tiny model has 4 heads: Ulysses over tp 2 x cp 4 leaves a tp rank's 2 heads to split over 4 ranks
    text = refused(tmp_path, actor(8, 2, context_parallel_size=4, context_parallel_algo="ulysses_cp_algo"))
    assert "num_attention_heads must be a multiple of tp x cp = 8; use megatron_cp_algo" in text
    assert parse(tmp_path, actor(8, 2, context_parallel_size=4, context_parallel_algo="megatron_cp_algo")).cp == 4
    assert "actor_config.context_parallel_size: 0: must be a positive integer" in \
        refused(tmp_path, actor(context_parallel_size=0))

    def reference(cp, algo="megatron_cp_algo"):
        def edit(tree):
            actor(context_parallel_size=2, context_parallel_algo="megatron_cp_algo")(tree)
            tree["rl_config"]["use_integrated_worker"] = False
            tree["rl_config"]["reference_resource"] = dict(tree["rl_config"]["actor_resource"])
            tree["ref_config"] = {"context_parallel_size": cp, "context_parallel_algo": algo, "micro_batch_size": 8,
                                  "load": tree["actor_config"]["load"]}
        return edit
    assert parse(tmp_path, reference(2)).cp == 2
    assert "ref_config.context_parallel_size: 1: the engine's reference runs on the actor's context parallel " \
        "layout; set 2" in refused(tmp_path, reference(1))
    assert "ref_config.context_parallel_algo: 'ulysses_cp_algo': the engine's reference runs the actor's context " \
        "parallel algorithm" in refused(tmp_path, reference(2, "ulysses_cp_algo"))


@pytest.mark.parametrize("where", ["parallel", "rl.actor.parallel"])
def test_run_refuses_hybrid_cp_before_launch(tmp_path, where):
    """hybrid_cp_algo has no Ulysses-degree key in MindSpeed-RL's config: `run` refuses it by field, exit 2,
    before anything starts (the engine refuses the rendered file again)."""
    from typer.testing import CliRunner

    from ascendfactory.cli import app

    spec = yaml.safe_load((ROOT / "examples" / "mindspeed-rl" / "grpo.yaml").read_text())
    spec.update(model_path=str(ROOT / spec["model_path"]), launcher="torchrun", output_dir=str(tmp_path / "run"),
                resources={"device": "cpu", "devices_per_node": 4})
    spec["data"]["path"] = str(ROOT / spec["data"]["path"])
    layout = {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}
    if where == "parallel":
        spec["parallel"] = layout
    else:
        spec["rl"]["actor"] = {"parallel": layout}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    res = CliRunner().invoke(app, ["run", str(job)])
    assert res.exit_code == 2, res.output
    assert f"{where}.cp_algo: mindspeed-rl offers ring / ulysses context parallel only" in " ".join(res.output.split())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
