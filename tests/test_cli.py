"""Every command of the CLI, through Typer's runner and (for exit codes and tracebacks) a subprocess."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ascendfactory.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def job_text(job_text):
    """The shared job, sharded so its memory estimate fits (the CLI checks memory)."""
    def make(**changes):
        parallel = {"tp": 2, "distributed_optimizer": True, **changes.pop("parallel", {})}
        return job_text(parallel=parallel, **changes)

    return make


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_capabilities_table_and_json():
    res = invoke("capabilities", "--model", "qwen3-32b")
    assert res.exit_code == 0, res.output
    for title in ("MindSpeed-LLM", "Llama-Factory", "MindSpeed-MM", "VeRL", "MindSpeed-RL", "✅", "❌"):
        assert title in res.output
    # qwen3-32b has a row in every table: "unlisted" shows up only in the legend line
    assert res.output.count("unlisted") == 1 and "unlisted: no row" in res.output
    res = invoke("capabilities", "--model", "Qwen/Qwen3-32B", "--json")
    data = json.loads(res.output)
    assert data["model"] == "qwen3-32b" and data["name"] == "Qwen3-32B" and data["type"] == "llm"
    assert data["frameworks"]["verl"]["methods"] == ["grpo", "dapo", "ppo"]
    assert data["frameworks"]["mindspeed-llm"]["lora"] == "supported"
    assert set(data["frameworks"]) == {"mindspeed-llm", "llamafactory", "mindspeed-mm", "verl", "mindspeed-rl"}
    res = invoke("capabilities", "--model", "qwen2-1.5b", "--json", "--framework", "verl")
    assert json.loads(res.output)["frameworks"] == {"verl": "unlisted"}


def test_capabilities_unknown_model_and_framework():
    res = invoke("capabilities", "--model", "qwen3-33b")
    assert res.exit_code == 2 and "qwen3-32b" in res.output
    res = invoke("capabilities", "--model", "qwen3-32b", "--framework", "verll")
    assert res.exit_code == 2 and "did you mean 'verl'" in res.output


def test_models_listing_and_filters():
    data = json.loads(invoke("models", "--json").output)
    assert len(data) == 35 + 28  # the first seed's cards, then the second seed's
    mm = json.loads(invoke("models", "--json", "--type", "multimodal").output)
    assert {m["family"] for m in mm} <= {"qwen2_vl", "qwen2_5_vl", "gemma3"} and len(mm) == 8
    rl = json.loads(invoke("models", "--json", "--framework", "mindspeed-rl").output)
    assert {m["model"] for m in rl} == {"qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-32b"}
    moe = json.loads(invoke("models", "--json", "--family", "qwen3_moe").output)
    assert {m["model"] for m in moe} == {"qwen3-30b-a3b", "qwen3-235b-a22b"}
    assert invoke("models").exit_code == 0
    # the second seed's backend column: FSDP2 lists Qwen3 (dense and MoE), Qwen3-Next, GLM5, MiniMax and Step
    fsdp2 = [m["model"] for m in json.loads(invoke("models", "--json", "--backend", "fsdp2").output)]
    assert fsdp2 == ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-235b-a22b",
                     "glm5-744b", "glm5.2-744b", "qwen3-next-80b-a3b", "minimax-m2.7-229b", "step-3.5-flash-196b"]
    mcore = {m["model"] for m in json.loads(invoke("models", "--json", "--backend", "mcore").output)}
    assert {"llama3.1-405b", "deepseek-v3-671b", "qwen3-8b", "mixtral-8x22b"} <= mcore
    assert not mcore & {"minimax-m2.7-229b", "step-3.5-flash-196b", "mamba2-8b", "qwen2-7b"}
    built = {m["model"] for m in json.loads(invoke("models", "--json", "--buildable").output)}
    assert {"chatglm3-6b", "qwen2.5-3b", "qwen3-8b", "llama3.1-405b", "mixtral-8x22b"} <= built
    assert not built & {"qwen3-next-80b-a3b", "deepseek-r1-distill-qwen-32b"}
    wrong = invoke("models", "--backend", "fsdp")
    assert wrong.exit_code == 2 and "did you mean 'fsdp2'" in wrong.output


def test_validate_many_files(tmp_path, job_text):
    good = write(tmp_path, job_text(), "good.yaml")
    bad = write(tmp_path, job_text(parallel={"tp": 3}), "bad.yaml")
    res = invoke("validate", good)
    assert res.exit_code == 0 and "✓" in res.output
    res = invoke("validate", good, bad)
    assert res.exit_code == 2 and "✓" in res.output and "✗" in res.output and "tp=3" in res.output


def test_validate_takes_overrides_for_every_file(tmp_path, job_text):
    good = write(tmp_path, job_text(), "good.yaml")
    other = write(tmp_path, job_text(model="qwen3-0.6b"), "other.yaml")
    res = invoke("validate", good, other, "parallel.tp=4")
    assert res.exit_code == 0 and res.output.count("tp 4") == 2, res.output
    res = invoke("validate", good, other, "parallel.tp=3")  # the override reaches both files
    assert res.exit_code == 2 and res.output.count("✗") == 2, res.output
    res = invoke("validate", good, "parallel.tpp=2")
    assert res.exit_code == 2 and "parallel.tpp" in res.output and "did you mean 'tp'" in res.output
    res = invoke("validate", "train.lr=1e-5")
    assert res.exit_code == 2 and "no job file given" in res.output


def test_plan_prints_layout_estimate_and_effective_config(tmp_path, job_text):
    job = write(tmp_path, job_text(parallel={"tp": 2, "pp": 2}))
    res = invoke("plan", job, "train.micro_batch=2")
    assert res.exit_code == 0, res.output
    assert "tp 2" in res.output and "dp 2" in res.output and "memory per device" in res.output
    assert "effective configuration" in res.output and "grad_clip" in res.output
    data = json.loads(invoke("plan", job, "--json").output)
    assert data["resolved"]["layout"]["dp"] == 2 and data["train"]["micro_batch"] == 1
    assert data["parallel"]["recompute"] == "none"


def test_plan_refuses_what_does_not_fit(tmp_path, job_text):
    job = write(tmp_path, job_text(model="qwen2.5-72b", resources={"devices_per_node": 1}, train={"global_batch": 1},
                                    parallel={"tp": 1}))
    res = invoke("plan", job)
    assert res.exit_code == 2
    assert "does not fit in device memory" in res.output and "optimizer_states" in res.output


def test_render_writes_the_run_files(tmp_path, job_text):
    job = write(tmp_path, job_text())
    res = invoke("render", job, "-o", tmp_path / "out")
    assert res.exit_code == 0, res.output
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"launch.sh", "mindspeed_llm_args.sh", "job.yaml", "exp-config.yaml"} <= names
    resolved = yaml.safe_load((tmp_path / "out" / "job.yaml").read_text())
    assert resolved["train"]["steps"] == 100 and resolved["model"] == "qwen3-8b"


def test_run_dry_run_and_refusal_of_missing_engine(tmp_path, job_text, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = write(tmp_path, job_text(output_dir=str(tmp_path / "run")))
    res = invoke("run", job, "--dry-run")
    assert res.exit_code == 0 and "dry run" in res.output and (tmp_path / "run" / "launch.sh").exists()
    from ascendfactory.engines import engine_info

    if not engine_info("mindspeed-mm").present:
        mm = write(tmp_path, job_text(framework="mindspeed-mm", model="qwen2.5-vl-7b", output_dir=str(tmp_path / "mm"),
                                      data={"path": "examples/data/vl_sft.json", "format": "sharegpt"}),
                   "mm.yaml")
        res = invoke("run", mm)
        assert res.exit_code == 2 and "engine is not in this build" in res.output
        assert (tmp_path / "mm" / "launch.sh").exists()


def test_run_refuses_cluster_launchers_and_missing_data(tmp_path, job_text, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sbatch here (tests/test_slurm.py has one)
    job = write(tmp_path, job_text(launcher="slurm", output_dir=str(tmp_path / "s")))
    res = invoke("run", job)
    assert res.exit_code == 2 and "sbatch is not on PATH" in res.output and "nothing was submitted" in res.output


def test_schema_is_json_schema():
    data = json.loads(invoke("schema").output)
    assert data["title"] == "AscendFactory job" and "parallel" in data["properties"]


@pytest.mark.parametrize("model,framework,stage", [
    ("qwen3-8b", "mindspeed-llm", "sft"), ("qwen2.5-14b", "llamafactory", "dpo"),
    ("qwen2.5-vl-7b", "mindspeed-mm", "pt"), ("qwen3-14b", "verl", "ppo"), ("qwen2.5-7b", "mindspeed-rl", "grpo"),
    ("chatglm3-6b", "mindspeed-llm", "sft"),  # a card of the second seed
])
def test_init_writes_a_starter_that_validates(tmp_path, model, framework, stage):
    out = tmp_path / "starter.yaml"
    res = invoke("init", "--model", model, "--framework", framework, "--stage", stage, "-o", out)
    assert res.exit_code == 0, res.output
    assert "#" in out.read_text()
    first = invoke("validate", out)   # the starter's data path is a placeholder: the one thing to fill in
    assert first.exit_code == 2 and first.output.splitlines()[1:3] == [
        "Inputs are missing", f"  data.path: {yaml.safe_load(out.read_text())['data']['path']} does not exist"]
    data = tmp_path / "train.json"
    data.write_text("[]")
    checked = invoke("validate", out, f"data.path={data}")
    assert checked.exit_code == 0 and "warning" not in checked.output, checked.output
    again = invoke("init", "--model", model, "--framework", framework, "--stage", stage, "-o", out)
    assert again.exit_code == 2 and "--force" in again.output


def test_second_seed_models_are_listed_and_refused_by_name_where_this_build_cannot_build_them(tmp_path, job_text):
    caps = invoke("capabilities", "--model", "qwen3-next-80b-a3b")
    assert caps.exit_code == 0
    flat = " ".join(caps.output.split())
    assert "recommended cluster 4x16" in flat and "backends mcore / fsdp2" in flat
    assert "qwen3_next architecture" in flat and "not buildable by this build" in flat
    data = json.loads(invoke("capabilities", "--model", "qwen3-next-80b-a3b", "--json").output)
    assert data["seed2"]["cluster"] == "4x16" and data["buildable"] is False
    for model, why in (("qwen3-next-80b-a3b", "no engine here builds qwen3_next"),
                       ("mamba2-8b", "no engine here builds mamba2"),
                       ("deepseek-r1-distill-qwen-32b", "architecture numbers are unknown here")):
        res = invoke("validate", write(tmp_path, job_text(model=model), f"{model}.yaml"))
        assert res.exit_code == 2 and "not buildable by this build" in res.output and why in res.output, res.output
        res = invoke("init", "--model", model, "--framework", "mindspeed-llm", "-o", tmp_path / "x.yaml")
        assert res.exit_code == 2 and why in res.output and not (tmp_path / "x.yaml").exists()
    # a second-seed row promises only what that seed states: LoRA is unstated (?), refused like ❌
    lora = invoke("validate", write(tmp_path, job_text(model="chatglm3-6b", finetuning="lora"), "lora.yaml"))
    assert lora.exit_code == 2 and "not stated by the seed" in lora.output, lora.output


def test_init_refuses_a_combination_the_matrix_refuses(tmp_path):
    res = invoke("init", "--model", "deepseek-v3-671b", "--framework", "llamafactory", "--stage", "sft",
                 "-o", tmp_path / "x.yaml")
    assert res.exit_code == 2 and "unlisted" in res.output and not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("model, framework, stage", [("qwen3-8b", "verl", "grpo"), ("qwen2.5-7b", "mindspeed-rl", "grpo"),
                                                   ("qwen3-8b", "llamafactory", "sft")])
def test_init_takes_the_framework_s_own_stage_by_default(tmp_path, model, framework, stage):
    out = tmp_path / "starter.yaml"
    res = invoke("init", "--model", model, "--framework", framework, "-o", out)
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(out.read_text())["stage"] == stage


def test_init_names_what_would_work_for_a_refused_combination(tmp_path):
    """qwen2.5-7b has no VeRL cell: init names the framework that trains it at grpo, and the models VeRL trains
    at grpo (what `models --framework verl --stage grpo` lists)."""
    res = invoke("init", "--model", "qwen2.5-7b", "--framework", "verl", "-o", tmp_path / "x.yaml")
    assert res.exit_code == 2 and not (tmp_path / "x.yaml").exists()
    listed = json.loads(invoke("models", "--framework", "verl", "--stage", "grpo", "--json").output)
    assert "qwen2.5-7b trains at stage grpo on mindspeed-rl" in res.output
    assert [r["model"] for r in listed][:3] and all(r["model"] in res.output for r in listed[:8])
    assert "qwen2.5-7b" not in [r["model"] for r in listed]
    res = invoke("init", "--model", "qwen3-8b", "--framework", "mindspeed-mm", "-o", tmp_path / "x.yaml")
    assert res.exit_code == 2 and "--framework: qwen3-8b trains at stage sft on mindspeed-llm" in res.output
    assert "mindspeed-mm trains stage sft for qwen2.5-vl" in res.output


def test_models_by_stage():
    dpo = [r["model"] for r in json.loads(invoke("models", "--stage", "dpo", "--json").output)]
    from ascendfactory.starter import trains

    assert dpo and all(trains(m, "llamafactory", "dpo") for m in dpo)
    assert invoke("models", "--stage", "rlhf").exit_code == 2


def test_matrix_check_passes():
    res = invoke("matrix", "check")
    assert res.exit_code == 0, res.output
    assert "backed / promised" in res.output and "matrix check passed" in res.output


def test_env_lists_versions():
    res = invoke("env")
    assert res.exit_code == 0, res.output
    assert "torch" in res.output and "collective backend" in res.output


def test_bad_job_exits_2_without_traceback(tmp_path):
    job = write(tmp_path, "model: qwen3-8b\nframework: mindspeed-llm\ndata: {path: x}\ntrain: {lrr: 1}\n")
    proc = subprocess.run([sys.executable, "-m", "ascendfactory", "validate", str(job)], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout and "did you mean 'lr'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ascendfactory", "plan", str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_reports_every_rl_role_layout():
    res = invoke("plan", ROOT / "examples/verl/qwen3-14b-ppo-vllm.yaml")
    assert res.exit_code == 0, res.output
    assert "  rollout: world 16" in res.output and "tp 2" in res.output and "  critic: world 16" in res.output
    data = json.loads(invoke("plan", ROOT / "examples/verl/qwen3-14b-ppo-vllm.yaml", "--json").output)
    assert data["resolved"]["role_layouts"]["rollout"]["tp"] == 2
    assert data["rl"]["critic"]["lr"] == 1e-5 and data["rl"]["actor"]["lr"] == data["train"]["lr"]
    assert data["rl"]["reference"]["parallel"]["tp"] == 1


def test_validate_reports_every_problem_in_one_pass_and_run_writes_nothing(tmp_path, monkeypatch):
    """Four mistakes of four kinds (schema, matrix, layout, inputs) come from one `validate`, each once,
    and `run` refuses the same job before it writes its run directory."""
    monkeypatch.chdir(ROOT)
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["train"]["learning_rate"] = 1e-4                   # schema: unknown key (train.lr)
    job["data"]["path"] = str(tmp_path / "missing.json")    # inputs
    job["finetuning"] = "freeze"                           # matrix: freeze is llamafactory's
    job["parallel"] = {"tp": 3}                            # layout: 3 divides neither heads nor the world
    job["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    res = invoke("validate", path)
    out = res.output
    assert res.exit_code == 2
    for said in ("train.learning_rate", "allowed here: lr,", "missing.json does not exist", "finetuning",
                 "parallel.tp"):
        assert said in out, (said, out)
    assert "with those fields at their defaults" in out
    assert invoke("run", path).exit_code == 2 and not (tmp_path / "run").exists()
    # a schema problem about a field is not repeated by the later checks that saw its default
    job["train"].pop("learning_rate")
    job["parallel"] = {"tp": "two"}
    path.write_text(yaml.safe_dump(job))
    out = invoke("validate", path).output
    assert out.count("parallel.tp") == 1 and "missing.json" in out and "finetuning" in out


def test_models_and_capabilities_read_at_80_columns():
    """In a real 80-column terminal: no line is wider, every model id and feature key is printed whole (the
    things a user copies), the rest wraps."""
    import subprocess
    import sys

    from ascendfactory import catalog

    env = {**__import__("os").environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}

    def show(*args):
        out = subprocess.run([sys.executable, "-m", "ascendfactory", *args], capture_output=True, text=True, env=env,
                             cwd=ROOT, check=True).stdout
        assert max(len(line) for line in out.splitlines()) <= 80, out
        return out

    models = show("models")
    assert all(f" {model_id} " in models for model_id in catalog.models()), models
    caps = show("capabilities", "--model", "qwen3-32b")
    keys = {key for fw in catalog.FRAMEWORKS if "qwen3-32b" in catalog.table(fw).rows for key in catalog.table(fw).features}
    assert keys and all(f"({key})" in caps for key in keys), caps
