"""VeRL: RL with FSDP actors (Ulysses sequence parallel), the ppo_trainer tree, backends.rl.

Rendering writes what VeRL reads: `verl_config.yaml` (ppo_trainer keys only), the prompts as
parquet (`train.parquet` / `val.parquet`: `prompt` as a chat-message list, `data_source` routing
the reward, `reward_model.ground_truth`, `extra_info.index`) converted from the job's prompt data,
and `engine.yaml` for AscendFactory's own settings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ascendfactory.errors import JobError, Problem
from ascendfactory.frameworks.base import FeatureUse, fsdp_states
from ascendfactory.frameworks.rl import RLAdapter

# the data_source VeRL's default_compute_score routes to each rule reward
DATA_SOURCE = {"gsm8k": "openai/gsm8k", "math": "lighteval/MATH"}
TRAIN_FILE, VAL_FILE = "train.parquet", "val.parquet"


class Verl(RLAdapter):
    name = "verl"
    engine_module = "backends.rl"
    columns = {"methods": "list", "sglang": "version", "vllm": "version", "train_backend": "version"}
    template = "engines/verl.yaml.j2"
    sidecar_template = "engines/verl.engine.yaml.j2"
    config_name = "verl_config.yaml"
    cp_algos = ("ulysses",)
    model_parallel = False
    starter_sharding = ({"fsdp": True},)

    def limits(self, job):
        """The FSDP backend: actor, reference and critic shard with FSDP and split sequences with
        Ulysses; only the rollout engine has tensor parallel."""
        blocks = {"parallel": job.parallel}
        blocks.update({f"rl.{role}.parallel": lay for role, lay in job.role_layouts().items()
                       if role in ("actor", "reference", "critic")})
        out, seen = [], set()
        for where, lay in blocks.items():
            dims = (lay.tp, lay.pp, lay.ep, lay.cp_algo if lay.cp > 1 else None)
            if dims in seen:
                continue  # a role that inherits the job's layout breaks nothing new
            seen.add(dims)
            if lay.tp > 1 or lay.pp > 1 or lay.ep > 1:
                out.append(self.refuse(where, "trains with its FSDP backend: tp, pp and ep must be 1",
                                       f"set {where}.tp/pp/ep: 1 and parallel.fsdp: true, or framework: mindspeed-rl"))
            if lay.cp > 1 and lay.cp_algo != "ulysses" and where != "parallel":
                out.append(self.refuse(f"{where}.cp_algo", "has Ulysses sequence parallel only",
                                       f"set {where}.cp_algo: ulysses"))
        p = job.parallel
        if p.distributed_optimizer or p.zero == 1:
            where = "parallel.distributed_optimizer" if p.distributed_optimizer else "parallel.zero"
            out.append(self.refuse(where, "shards with FSDP (actor.strategy fsdp / fsdp2): it has no "
                                   "optimizer-only sharding", "set parallel.fsdp: true (or zero: 2 / 3) to shard, "
                                   "or leave sharding out to replicate"))
        if job.rl is not None:
            reward = job.rl.reward
            if reward.type in ("exact_match", "length"):
                out.append(self.refuse("rl.reward.type", f"routes rule rewards by data_source (gsm8k, math); "
                                       f"{reward.type} has none", "use type: gsm8k or math, or type: function"))
            if reward.type == "function" and ".py:" not in (reward.function or ""):
                out.append(self.refuse("rl.reward.function", "loads a custom reward function from a file "
                                       "(reward.custom_reward_function.path)", "write it as path/to/file.py:function"))
            rollout = job.rl.rollout.parallel
            if rollout is not None and rollout.pp > 1:
                out.append(self.refuse("rl.rollout.parallel.pp", "runs backends.rl, which has no pipeline-parallel "
                                       "rollout (VeRL's rollout.pipeline_model_parallel_size)",
                                       "set rl.rollout.parallel.pp: 1"))
        return out

    def no_effect(self, job):
        return {**super().no_effect(job),
                "train.min_lr": "the actor trains at a constant learning rate after warm-up (no decay to a floor)",
                "kernels.flash_attention": "backends.rl picks its attention kernel itself (exact attention either "
                                           "way: a speed setting)"}

    def features_used(self, job, distributed):
        return self.role_features(job) + [FeatureUse("train_backend", "the actor trains with FSDP")]

    def env(self, job, run_dir: str) -> dict[str, str]:
        """VeRL's Tracking: TensorBoard in $TENSORBOARD_DIR (else tensorboard_log/<project>/<experiment> in the
        working directory), W&B in wandb's own $WANDB_DIR."""
        out = {}
        if "tensorboard" in job.train.report_to:
            out["TENSORBOARD_DIR"] = f"{run_dir}/tensorboard"
        if "wandb" in job.train.report_to:
            out["WANDB_DIR"] = run_dir
        return out

    def plan_warnings(self, job):
        """VeRL 0.9.1's V1 trainer ignores algorithm.filter_groups.max_num_gen_batches (trainer_base.py warns
        and refills the batch without bound); backends.rl stops after that many rounds."""
        if job.stage != "dapo" or job.rl is None:
            return []
        return [f"rl.max_gen_rounds {job.rl.max_gen_rounds}: rendered as algorithm.filter_groups.max_num_gen_batches, "
                "which VeRL 0.9.1's V1 trainer ignores (it refills the batch without bound); backends.rl stops after "
                f"{job.rl.max_gen_rounds} generation rounds and trains on the groups kept"]

    def rl_batch_rules(self, job, world, role="actor"):
        """VeRL 0.9.1 (FSDP, fixed micro-batches as the template renders them): each rank's mini-batch share in whole
        ppo_micro_batch_size_per_gpu micro-batches for the actor (its engine's prepare_micro_batches
        asserts it); prompts x n over every device. The critic's share is not held to whole critic
        micro-batches: VeRL 0.9.1's critic engine (engine_workers.TrainingWorker, an EngineConfig whose
        use_dynamic_bsz stays True) packs its micro-batches by ppo_max_token_len_per_gpu tokens, and
        CriticConfig only asks that a micro-batch size is set."""
        if role == "critic":
            return {"who": "VeRL", "world": world}
        return {"who": "VeRL", "micro_share": "mini_batch", "world": world}

    def states(self, job, on_device, trainable, layer_only, c, dp):
        # replicated (fsdp_size 1): FSDP over groups of one rank, the whole states on every rank
        return fsdp_states(job, on_device, trainable, layer_only, c, dp if sharded(job) else 1)

    def shards_frozen_copies(self, job):
        return sharded(job)

    def probe(self, job, row, feature, stage):
        super().probe(job, row, feature, stage)
        job["parallel"]["fsdp"] = True

    # ------------------------------------------------------------------ rendering

    def render_config(self, shell, yml, context, job, run_dir: Path):
        t, rl = job.train, job.rl
        # VeRL's dataloader drops the last partial batch; data not converted here (parquet, or a path
        # not on this machine): counted as one batch an epoch, so total_epochs is never too small
        rows = prompt_rows(job) if converts(job) else []
        per_epoch = max(len(rows) // t.global_batch, 1)
        if t.steps is not None:
            epochs, steps = max(math.ceil(t.steps / per_epoch), 1), t.steps
        else:
            epochs = max(math.ceil(t.epochs), 1)
            steps = None if float(t.epochs).is_integer() else max(int(t.epochs * per_epoch), 1)
        source = None if converts(job) else job.data.path
        function = rl.reward.function if rl.reward.type == "function" else None
        path, _, name = (function or "").rpartition(":")
        context = dict(context, verl={
            "train_files": str(Path(source).resolve()) if source else str(run_dir / TRAIN_FILE),
            "val_files": str(Path(source).resolve()) if source else str(run_dir / VAL_FILE),
            "total_epochs": epochs, "total_training_steps": steps,
            "clip_high": rl.clip_eps_high if rl.clip_eps_high is not None else
            (0.28 if job.stage == "dapo" else rl.clip_eps_low),
            "function_path": str(Path(path).resolve()) if function else None, "function_name": name or None,
            **fsdp_layout(job)})
        return super().render_config(shell, yml, context, job, run_dir)

    def extra_files(self, context: dict[str, Any], job) -> dict[str, Any]:
        if not converts(job):
            return {}  # read where it is (a data path not on this machine: the run directory must get it)
        data = parquet_bytes(prompt_rows(job))
        # no validation split in the job: VeRL's val_files holds the same prompts (no validation runs)
        return {TRAIN_FILE: data, VAL_FILE: data}


def sharded(job) -> bool:
    """Whether the job shards the RL models' states over data parallel (parallel.fsdp, or ZeRO 2 / 3)."""
    return bool(job.parallel.fsdp or job.parallel.zero >= 2)


def fsdp_layout(job) -> dict[str, Any]:
    """What VeRL's FSDP keys mean for the job's parallel block, for the actor, the reference and the
    critic alike: strategy fsdp2 (parallel.fsdp is FSDP2) with fsdp_config.fsdp_size -1 (shard over
    every rank) when the job shards; fsdp_size 1 (VeRL's hybrid shard with groups of one rank, i.e.
    replicated data parallel) when it does not; ZeRO-2 is FSDP that keeps the parameters gathered
    between forward and backward (reshard_after_forward false)."""
    return {"strategy": "fsdp2", "fsdp_size": -1 if sharded(job) else 1,
            "reshard_after_forward": not (job.parallel.zero == 2 and not job.parallel.fsdp)}


def converts(job) -> bool:
    """Whether rendering writes the parquet prompts: prompt-format JSON / JSONL data on this machine."""
    return job.data.format == "prompt" and not is_parquet(job) and Path(job.data.path).is_file()


def is_parquet(job) -> bool:
    return Path(job.data.path).suffix == ".parquet"


def prompt_rows(job) -> list[dict]:
    """The job's prompt-format JSON / JSONL rows as VeRL's (a parquet data path is read by the engine as it is)."""
    path = Path(job.data.path)
    key = job.data.answer_key or "answer"
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    except (OSError, ValueError) as err:
        raise JobError("The prompt data cannot be read", [Problem("data.path", f"{path}: {err}")]) from None
    reward = job.rl.reward.type if job.rl else "gsm8k"
    rows, problems = [], []
    for i, r in enumerate(raw):
        if not isinstance(r, dict) or not isinstance(r.get("prompt"), (str, list)):
            problems.append(Problem("data.path", f"{path} row {i}: no prompt (a string or chat messages)"))
            continue
        if r.get(key) is None and reward != "function":
            problems.append(Problem("data.answer_key", f"{path} row {i}: no {key!r} field (the answer the reward "
                                    "compares to)", hint="add it, or name the field with data.answer_key"))
            continue
        prompt = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
        row = {"data_source": r.get("data_source") or DATA_SOURCE.get(reward, reward), "prompt": prompt,
               "ability": r.get("ability", "math"),
               "reward_model": {"style": "rule", "ground_truth": str(r.get(key, ""))},
               "extra_info": {"index": i}}
        if "images" in r:  # a VL prompt's images (data.image_key): VeRL's {"image": path}, relative to the data file
            files = r["images"] if isinstance(r["images"], list) else [r["images"]]
            row["images"] = [{"image": str((path.parent / f).resolve()) if isinstance(f, str) else f} for f in files]
        rows.append(row)
    if any("images" in r for r in rows):  # one parquet schema: every row gets the column
        for r in rows:
            r.setdefault("images", [])
    if problems:
        raise JobError("The prompt data does not fit an RL job", problems[:5])
    if not rows:
        raise JobError("The prompt data is empty", [Problem("data.path", f"{path}: no prompts")])
    return rows


_TO_PARQUET = """
import io, json, sys
import pyarrow as pa, pyarrow.parquet as pq
out = io.BytesIO()
pq.write_table(pa.Table.from_pylist(json.load(sys.stdin)), out)
sys.stdout.buffer.write(out.getvalue())
"""


def parquet_bytes(rows: list[dict]) -> bytes:
    """The rows as a parquet file, written by pyarrow in a child process: the orchestrator itself
    imports nothing heavy (pyarrow pulls in numpy)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _TO_PARQUET], input=json.dumps(rows).encode(),
                          capture_output=True, timeout=300)
    if proc.returncode:
        raise JobError("The prompts cannot be written as parquet", [Problem(
            "data.path", proc.stderr.decode(errors="replace").strip().splitlines()[-1] if proc.stderr else "pyarrow failed",
            hint="pip install pyarrow")])
    return proc.stdout


ADAPTER = Verl()
