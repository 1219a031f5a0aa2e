"""Pipeline-parallel RL actors (the MindSpeed-RL dialect's Megatron backend): the example job
examples/mindspeed-rl/grpo.yaml, rendered, with actor_config.pipeline_model_parallel_size 2 on 2 processes,
and pp 2 x tp 2 and pp 2 x dp 2 on 4, equals the 1-process run over 3 steps: losses, rewards, grad norms,
KL / clip / entropy metrics and the trained weights within 1e-5, each layout trained on the one-process run's
samples (_rl_pp_worker.py says why). Rollout runs on the whole model gathered over the stages (the same
samples on every pp rank: test_the_rollout_samples_as_one_process); the old / reference / current log-probs
run through the stages (hidden states sent stage to stage, the last stage's log-probs broadcast over pp), the
update backpropagates through them and clips with the norm over every stage (backends/rl/pipeline_parallel.py)."""

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.rl_runs import ROOT, Launches, assert_same_training, steps
from tests.rl.test_mindspeed_rl_engine import parse, refused, rendered
from tests.rl.test_rl_tensor_parallel import KEYS

# processes: [(case, actor tp, actor pp)]; one launch per world; *_tied: the model with tied embeddings
LAUNCHES = {1: [("pp1", 1, 1), ("pp1_tied", 1, 1)], 2: [("pp2", 1, 2), ("pp2_tied", 1, 2)],
            4: [("pp2tp2", 2, 2), ("pp2dp2", 1, 2)]}


def _tied_model(out: Path) -> Path:
    """The example's policy with its output head tied to the embedding (as Qwen2.5-1.5B's): the first stage
    embeds with the weight the last stage projects with."""
    from safetensors.torch import load_file, save_file

    src = ROOT / "examples" / "tiny-qwen3-arith"
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(src / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights.pop("lm_head.weight").clone()  # keep the trained head
    save_file(weights, str(out / "model.safetensors"))
    return out


def _job(run_dir: Path, name: str, tp: int, pp: int, world: int) -> Path:
    """The rendered MindSpeed-RL file at actor tp / pp (the reference the integrated worker's), 3 steps."""
    tree = yaml.safe_load((run_dir / "mindspeed_rl.yaml").read_text())
    # clip_grad 0.5: the first steps' norms are above it, so the clipping (by the norm over every stage) bites
    tree["actor_config"].update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, train_iters=3,
                                clip_grad=0.5)
    tree["rl_config"]["actor_resource"]["num_npus"] = world
    if name.endswith("_tied"):  # run_dir is the tied cases' own rendering: its model file says tied
        # the head moved into the embedding answers nothing right (rewards 0): the entropy bonus trains it
        tree["rl_config"]["entropy_coeff"] = 0.05
        model = run_dir / "tied_model"
        if not model.exists():
            _tied_model(model)
        tree["actor_config"]["load"] = tree["megatron_training"]["tokenizer_name_or_path"] = \
            tree["generate_config"]["tokenizer_name_or_path"] = str(model)
        model_file = run_dir / "model" / f"{tree['megatron_training']['model']}.yaml"
        models = yaml.safe_load(model_file.read_text())
        models[tree["megatron_training"]["model"]]["untie_embeddings_and_output_weights"] = False
        model_file.write_text(yaml.safe_dump(models, sort_keys=False))
    out = run_dir / f"mindspeed_rl_{name}.yaml"
    out.write_text(yaml.safe_dump(tree, sort_keys=False))
    return out


def _resume_cases(tmp: Path) -> list[dict]:
    """test_rl_loop's GRPO case (RLConfig directly: the MindSpeed-RL dialect has no resume key) at pp 2: 3 steps
    straight, and cut after step 2 then resumed to step 3 and exported."""
    from tests.rl.test_rl_loop import CASES

    # framework: pipeline parallel actors are the MindSpeed-RL dialect's (the VeRL one's LIMITS refuse pp 2 at start)
    grpo = dict(next(c for c in CASES if c["name"] == "grpo"), pp=2, framework="mindspeed-rl")
    saved = str(tmp / "pp_ckpt")
    return [dict(grpo, name="pp2_straight"), dict(grpo, name="pp2_cut", total_steps=2, save_dir=saved),
            dict(grpo, name="pp2_resumed", save_dir=saved, resume="auto", export_hf=str(tmp / "pp_export"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases under _rl_pp_worker.py: the run worker that also records every rank's log-probs."""
    tmp = tmp_path_factory.mktemp("rl_pp")
    job = rendered("examples/mindspeed-rl/grpo.yaml", tmp / "job")
    tied = rendered("examples/mindspeed-rl/grpo.yaml", tmp / "job_tied")
    def case(name, tp, pp, world):
        replay = {} if world == 1 else {"replay": str(tmp / "np1" / _base(name))}
        return {"name": name, "file": str(_job(tied if name.endswith("_tied") else job, name, tp, pp, world)),
                **replay}
    launches = {world: [case(n, tp, pp, world) for n, tp, pp in cases] for world, cases in LAUNCHES.items()}
    launches[2] += _resume_cases(tmp)
    return _BaseFirst("_rl_pp_worker.py", tmp, launches)


def _base(name: str) -> str:
    return "pp1_tied" if name.endswith("_tied") else "pp1"


class _BaseFirst(Launches):
    """The one-process launch runs before any other: the layouts replay its samples."""

    def __missing__(self, name: str) -> Path:
        if name not in ("pp1", "pp1_tied"):
            self["pp1"]
        return super().__missing__(name)


def _drawn(folder: Path, case: str, rank: int) -> list[dict]:
    """Each generation call's responses as the case's sampler drew them on that rank."""
    return [json.loads(line) for line in (folder / f"{case}.rollout{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["pp2", "pp2tp2", "pp2dp2", "pp2_tied"])
def test_pipeline_parallel_matches_one_process(runs, name):
    """(pp2_tied: the tied output weight trained by the first and the last stage, its gradient summed over
    both, counted once in the norm.)"""
    base = _base(name)
    assert_same_training((runs[base], base), (runs[name], name), KEYS)
    # the run does something: the policy moves, the KL term is live, the samples differ, the clipping bites
    one = steps(runs[base], base)
    assert all(r["grad_norm"] > 0 for r in one) and any(abs(r["actor/kl_loss"]) > 0 for r in one[1:])
    if base == "pp1":
        assert len({r["reward_mean"] for r in one}) > 1 and any(r["grad_norm"] > 0.5 for r in one)


@pytest.mark.parametrize("name,world,tp,dp", [("pp2", 2, 1, 1), ("pp2tp2", 4, 2, 1), ("pp2dp2", 4, 1, 2)])
def test_the_rollout_samples_as_one_process(runs, name, world, tp, dp):
    """The layout's own sampler (before the replay): every pp rank draws its dp rank's contiguous share of the
    prompts with each sample's stream (seed, step, prompt id), the same on every pp / tp rank of a dp rank, and
    together they cover the one-process run's prompts and samples, every step. At pp 2 (tp 1, dp 1) the rollout
    runs the gathered whole model on the whole batch, as one process does: its first step's responses are the
    one-process ones exactly (same weights, same shapes, same streams). Where tp splits the matmuls or dp
    halves the batch, logits differ at float noise and a draw may land on the other side of a cumulative
    probability on some CPUs, so there only the prompts and the sample counts are compared."""
    one = _drawn(runs["pp1"], "pp1", 0)
    assert len(one) == 3 and all(len(call) == 8 and all(len(v) == 8 for v in call.values()) for call in one)
    ranks = [_drawn(runs[name], name, rank) for rank in range(world)]
    for step, whole in enumerate(one):
        together = {}
        for d in range(dp):  # the recipe's rank order: pp outermost, then dp, then tp
            calls = [ranks[r][step] for r in range(world) if (r // tp) % dp == d]
            assert all(c == calls[0] for c in calls), (name, step, d)  # every pp / tp rank drew the same
            assert len(calls[0]) == 8 // dp and not set(calls[0]) & set(together)
            together.update(calls[0])
        assert set(together) == set(whole)
        assert all(len(together[k]) == 8 for k in whole)
    if name == "pp2":
        assert ranks[0][0] == one[0]


@pytest.mark.parametrize("name,world", [("pp2", 2), ("pp2tp2", 4), ("pp2dp2", 4)])
def test_every_pipeline_rank_holds_the_log_probs(runs, name, world):
    """The old and reference log-probs come out of the last stage; every rank (first stage included) holds
    the one-process values for each of its rows, every step."""
    def logps(folder, case, rank):
        return [json.loads(line) for line in (folder / f"{case}.logp{rank}.jsonl").read_text().splitlines()]
    one = logps(runs["pp1"], "pp1", 0)
    assert len(one) == 3 and all(len(s) == 64 for s in one)  # 8 prompts x 8 responses a step
    for rank in range(world):
        mine = logps(runs[name], name, rank)
        assert len(mine) == 3
        for a, b in zip(one, mine):
            assert b and set(b) <= set(a)
            for index, (old, ref) in b.items():
                for x, y in zip(a[index], (old, ref)):
                    assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (name, rank, index, a[index], (old, ref))


def test_resume_and_export_under_pipeline_parallel(runs, tmp_path_factory):
    """Each rank checkpoints the whole actor (its stage trained, the rest refreshed from the other stages) and
    its own stage's optimizer state: a run cut after step 2 and resumed ends with the straight run's weights
    and step-3 loss, and the export (rank 0, pp stage 0) holds every stage's trained weights."""
    from safetensors.torch import load_file

    folder = runs["pp2"]  # the 2-process launch runs these cases after pp2's
    straight, resumed = (json.loads((folder / f"{n}.params").read_text()) for n in ("pp2_straight", "pp2_resumed"))
    assert straight == pytest.approx(resumed, rel=1e-12, abs=1e-12)
    assert [r["step"] for r in steps(folder, "pp2_resumed")] == [3]
    assert steps(folder, "pp2_resumed")[0]["loss"] == steps(folder, "pp2_straight")[-1]["loss"]
    weights = {}
    for f in (folder.parent / "pp_export").glob("*.safetensors"):
        weights.update(load_file(str(f)))
    exported = [sum(float(t.double().sum()) for t in weights.values()),
                sum(float((t.double() ** 2).sum()) for t in weights.values())]
    assert exported == pytest.approx(straight, rel=1e-12)


# ---------------------------------------------------------------------- the rendered file and refusals


def _msrl_job(parallel: dict, world: int):
    from ascendfactory.job_file import parse_job

    spec = yaml.safe_load((ROOT / "examples" / "mindspeed-rl" / "grpo.yaml").read_text())
    spec.update(parallel=parallel, launcher="torchrun", resources={"device": "cpu", "devices_per_node": world})
    if parallel.get("tp", 1) > 1:  # the rollout inherits the job's tp; this engine reads infer tp 1 only
        spec["rl"]["rollout"]["parallel"] = {"tp": 1}
    return parse_job(yaml.safe_dump(spec))


@pytest.mark.parametrize("parallel,world", [({"pp": 2}, 2), ({"pp": 2, "tp": 2}, 4)])
def test_a_job_at_pp_2_renders_the_keys_and_the_engine_reads_them(tmp_path, monkeypatch, parallel, world):
    """parallel.pp 2 on the mindspeed-rl framework: `run`'s checks pass (LIMITS parallel.pp, the
    megatron_backend cell), actor_config carries pipeline_model_parallel_size 2, the rollout's inference
    layout stays at infer_pipeline_parallel_size 1 (it is not the training's), and the engine parses the
    file to pp 2."""
    from ascendfactory.engines import require_ready
    from ascendfactory.frameworks.mindspeed_rl import ADAPTER
    from ascendfactory.plan import make_plan
    from ascendfactory.render import render, write_files

    monkeypatch.chdir(ROOT)
    job = _msrl_job(parallel, world)
    require_ready(job)  # `run`'s check before launch: raises on a parallel.pp over the engine's LIMITS
    assert "megatron_backend" in [use.feature for use in ADAPTER.features_used(job, True)]
    write_files(render(make_plan(job, check_memory=False), tmp_path), tmp_path)
    tree = yaml.safe_load((tmp_path / "mindspeed_rl.yaml").read_text())
    assert tree["actor_config"]["pipeline_model_parallel_size"] == 2
    assert tree["generate_config"]["infer_pipeline_parallel_size"] == 1
    assert tree["rl_config"]["actor_resource"]["num_npus"] == world
    cfg = parse(tmp_path)
    assert (cfg.pp, cfg.tp, cfg.cp, cfg.expected_world) == (2, parallel.get("tp", 1), 1, world)


def test_pipeline_parallel_refusals_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rendered("examples/mindspeed-rl/grpo.yaml", tmp_path)

    def actor(npus=2, tp=1, **keys):
        return lambda t: (t["actor_config"].update(tensor_model_parallel_size=tp, **keys),
                          t["rl_config"]["actor_resource"].update(num_npus=npus))
    assert parse(tmp_path, actor(pipeline_model_parallel_size=2)).pp == 2
    assert parse(tmp_path, actor(4, 2, pipeline_model_parallel_size=2)).pp == 2
    # the tiny model has 2 layers: pp 4 cannot split them evenly
    text = refused(tmp_path, actor(4, pipeline_model_parallel_size=4))
    assert "actor_config.pipeline_model_parallel_size: 4 does not divide num_layers 2" in text
    text = refused(tmp_path, actor(2, 2, pipeline_model_parallel_size=2))
    assert "rl_config.actor_resource.num_npus: 2 is not a multiple of actor_config.tensor_model_parallel_size 2 x " \
        "actor_config.context_parallel_size 1 x actor_config.pipeline_model_parallel_size 2" in text
    text = refused(tmp_path, actor(4, pipeline_model_parallel_size=2, context_parallel_size=2,
                                   context_parallel_algo="megatron_cp_algo"))
    assert "pipeline x context parallel RL actors are not built" in text
    assert "actor_config.num_layer_list: MindSpeed-RL's key, but this engine does not implement it" in \
        refused(tmp_path, actor(pipeline_model_parallel_size=2, num_layer_list="1,1"))
    assert "actor_config.num_layers_per_virtual_pipeline_stage: 1: the engine's pipeline runs one stage per pp " \
        "rank" in refused(tmp_path, actor(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1))
    assert "actor_config.pipeline_model_parallel_size: 0: must be a positive integer" in \
        refused(tmp_path, actor(pipeline_model_parallel_size=0))
    assert "actor_config.expert_model_parallel_size: 2:" in refused(tmp_path, actor(expert_model_parallel_size=2))

    def reference(pp):
        def edit(tree):
            actor(pipeline_model_parallel_size=2)(tree)
            tree["rl_config"]["use_integrated_worker"] = False
            tree["rl_config"]["reference_resource"] = dict(tree["rl_config"]["actor_resource"])
            tree["ref_config"] = {"pipeline_model_parallel_size": pp, "micro_batch_size": 8,
                                  "load": tree["actor_config"]["load"]}
        return edit
    assert parse(tmp_path, reference(2)).pp == 2
    assert "ref_config.pipeline_model_parallel_size: 1: the engine's reference runs on the actor's pipeline " \
        "parallel layout; set 2" in refused(tmp_path, reference(1))


@pytest.mark.parametrize("parallel,devices,field", [
    ({"pp": 4}, 4, "parallel.pp: 2 layers do not split evenly over pp=4"),
    ({"pp": 2, "tp": 2}, 2, "parallel: data parallel size = world / (tp·pp·cp) = 2 / 4"),
    ({"pp": 2, "pp_layers": [1, 1]}, 2, "parallel.pp_layers: mindspeed-rl splits the layers evenly over the "
                                        "pipeline stages"),
    ({"pp": 2, "vpp": 2}, 2, "parallel.vpp: mindspeed-rl splits the layers evenly over the pipeline stages"),
    ({"pp": 2, "cp": 2}, 4, "parallel.pp: mindspeed-rl has no pipeline x context parallel RL actors"),
])
def test_run_refuses_a_bad_pipeline_layout_before_launch(tmp_path, parallel, devices, field):
    """A pp that does not split the model's layers, pp x tp more than the devices, an uneven or interleaved
    split, pp x cp: `run` exits 2 naming the field, before anything starts."""
    from typer.testing import CliRunner

    from ascendfactory.cli import app

    spec = yaml.safe_load((ROOT / "examples" / "mindspeed-rl" / "grpo.yaml").read_text())
    spec.update(model_path=str(ROOT / spec["model_path"]), launcher="torchrun", output_dir=str(tmp_path / "run"),
                resources={"device": "cpu", "devices_per_node": devices}, parallel=parallel)
    spec["data"]["path"] = str(ROOT / spec["data"]["path"])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    res = CliRunner().invoke(app, ["run", str(job)])
    assert res.exit_code == 2, res.output
    assert field in " ".join(res.output.split()), res.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
