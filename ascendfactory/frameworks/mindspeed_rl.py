"""MindSpeed-RL: RL with Megatron-style actors, the MindSpeed-RL YAML, backends.rl.

Rendering writes what MindSpeed-RL reads: `mindspeed_rl.yaml` (its sections; every key one its config
classes accept), the model file its `defaults` composes (`model/<name>.yaml`, the published
configs/model format), the prompts as JSONL rows (`prompt`, and the answer as `labels`, the
dataset_additional_keys MindSpeed-RL's verifiers read) converted from the job's prompt data, and
`engine.yaml` for AscendFactory's own settings."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ascendfactory.frameworks.base import FeatureUse
from ascendfactory.frameworks.rl import RLAdapter, role_cp
from ascendfactory.frameworks.verl import converts, prompt_rows
from backends.contract.megatron import MINDSPEED_RL_CP_ALGOS

PROMPTS_FILE = "prompts.jsonl"
MODEL_DIR = "model"
# MindSpeed-RL's templates (configs/model/templates.json) by model family
PROMPT_TYPE = {"qwen2": "qwen", "qwen3": "qwen3", "llama": "llama3", "mistral": "mistral", "mixtral": "mixtral",
               "gemma": "gemma", "deepseek": "deepseek3"}
# job reward type -> MindSpeed-RL verifier_function name (gsm8k: backends.rl's "#### <n>" verifier;
# MindSpeed-RL's own registry has no GSM8K verifier, see backends/rl/mindspeed_rl/verifiers.py)
VERIFIER = {"gsm8k": "gsm8k", "math": "math_17k_acc"}


def model_name(model_id: str) -> str:
    """MindSpeed-RL's model file names: qwen2.5-7b -> qwen25_7b, qwen3-8b -> qwen3_8b."""
    return re.sub(r"[^a-z0-9_]", "_", model_id.lower().replace(".", ""))


# rl.loss_agg -> rl_config.token_level_loss
LOSS_AGG = {"token-mean": True, "seq-mean-token-mean": False}


class MindSpeedRL(RLAdapter):
    name = "mindspeed-rl"
    engine_module = "backends.rl"
    columns = {"methods": "list", "vllm": "version", "megatron_backend": "flag", "long_seq": "flag"}
    template = "engines/mindspeed-rl.yaml.j2"
    model_template = "engines/mindspeed-rl.model.yaml.j2"
    sidecar_template = "engines/verl.engine.yaml.j2"   # backends.rl's sidecar, the same for both dialects
    config_name = "mindspeed_rl.yaml"
    rollout_engines = ("vllm", "hf")
    # context_parallel_algo megatron_cp_algo / ulysses_cp_algo (backends.rl refuses hybrid_cp_algo too)
    cp_algos = MINDSPEED_RL_CP_ALGOS

    def features_used(self, job, distributed):
        uses = self.role_features(job)
        uses.append(FeatureUse("megatron_backend", "the actor trains with the Megatron-style backend"))
        cp = role_cp(job)
        if cp > 1:
            uses.append(FeatureUse("long_seq", f"context parallel cp={cp}"))
        return uses

    def limits(self, job):
        out = []
        p = job.parallel
        if not (p.cp > 1 and p.cp_algo not in self.cp_algos):  # else common_limits names parallel.cp_algo
            for role, lay in job.role_layouts().items():  # once, at the first role (the others inherit it)
                if getattr(lay, "cp", 1) > 1 and lay.cp_algo not in self.cp_algos:
                    out.append(self.refuse(f"rl.{role}.parallel.cp_algo", "offers ring / ulysses context parallel "
                                           "only (MindSpeed-RL has no key for hybrid_cp_algo's Ulysses degree)",
                                           f"set rl.{role}.parallel.cp_algo: ring or ulysses"))
                    break
        # backends.rl's pipeline: pp equal stages, one per rank, no cp; named once, where the layout is set
        for where, lay in [("parallel", job.parallel)] + [(f"rl.{role}.parallel", lay)
                                                          for role, lay in job.role_layouts().items()]:
            problem = _pipeline_problem(lay)
            if problem:
                key, message, hint = problem
                out.append(self.refuse(f"{where}.{key}", message, hint))
                break
        if job.rl is not None:
            reward = job.rl.reward
            if reward.type in ("exact_match", "length", "function"):
                out.append(self.refuse("rl.reward.type", f"scores with its rule verifiers (rl_config.verifier_function); "
                                       f"{reward.type} has none", "use type: gsm8k or math"))
            if job.rl.loss_agg not in LOSS_AGG:
                out.append(self.refuse("rl.loss_agg", f"aggregates the loss per token or per sequence "
                                       f"(rl_config.token_level_loss), not {job.rl.loss_agg}",
                                       f"set rl.loss_agg: {' or '.join(LOSS_AGG)}"))
        if p.fsdp or p.zero:
            where = "parallel.fsdp" if p.fsdp else "parallel.zero"
            out.append(self.refuse(where, "trains its actor with Megatron: it has no FSDP or ZeRO stages",
                                   "shard the optimizer with parallel.distributed_optimizer: true instead"))
        return out

    def no_effect(self, job):
        return {**super().no_effect(job),
                "rl.dual_clip_c": "its GRPO loss is the plain clipped surrogate (no dual clip)"}

    def plan_warnings(self, job):
        """MindSpeed-RL's validate_rl_args raises unless the actor trains in bf16 and vLLM generates in
        bfloat16; the template renders bf16 / dtype from train.precision, so only a bf16 job starts there."""
        out = []
        if set(job.train.report_to) == {"tensorboard", "wandb"}:
            out.append("train.report_to: MindSpeed-RL's trainer opens TensorBoard only without W&B, so with use_wandb "
                       "the rendered use_tensorboard writes nothing; ask for one of them to get it")
        p = job.train.precision
        if p == "bf16":
            return out
        return out + [f"train.precision {p}: MindSpeed-RL itself refuses the rendered {self.config_name} (its "
                "validate_rl_args: 'megatron_config.bf16 should be true and generate_config.dtype should be "
                f"bfloat16'); backends.rl runs it in {p}, but to run the file on MindSpeed-RL set "
                "train.precision: bf16"]

    # ------------------------------------------------------------------ rendering

    def rl_batch_rules(self, job, world, role="actor"):
        """MindSpeed-RL's validate_rl_args: each rank's rollout share (global_batch_size / dp x
        n_samples_per_prompt) in whole micro_batch_size micro-batches; the prompts over the
        generation's data-parallel size (devices / (infer tp x pp)); a reference with its own worker
        (use_integrated_worker false): the prompts over its data-parallel size (reference_resource
        num_npus, rendered as the job's devices, / (its tp x pp x cp)) and each of its ranks' share in
        whole ref_config micro_batch_size (the job's train.micro_batch) micro-batches."""
        gen = job.rl.rollout.parallel
        rules = {"who": "MindSpeed-RL", "micro_share": "rollout",
                 "rollout_dp": world // (gen.tp * gen.pp) if gen is not None else None}
        ref = job.role_layouts().get("reference")
        if not integrated(job) and ref is not None:
            rules.update(ref_dp=world // (ref.tp * ref.pp * ref.cp), ref_micro=job.train.micro_batch)
        return rules

    def _facts(self, context: dict[str, Any], job) -> dict[str, Any]:
        rl, t = job.rl, job.train
        steps = t.steps if t.steps is not None else None
        clip_high = rl.clip_eps_high if rl.clip_eps_high is not None else (0.28 if job.stage == "dapo"
                                                                            else rl.clip_eps_low)
        run_dir = Path(context["paths"]["run_dir"])
        return {"model_name": model_name(context["model_id"]),
                "data_path": str(run_dir / PROMPTS_FILE) if converts(job) else job.data.path,
                "prompt_type": job.data.template or PROMPT_TYPE.get(context["family"], "empty"),
                "verifier": VERIFIER.get(rl.reward.type, rl.reward.type),
                "integrated": integrated(job), "clip_high": clip_high,
                "train_iters": steps if steps is not None else self._epoch_iters(job),
                "warmup_fraction": round(t.warmup_steps / steps, 6) if steps and t.warmup_steps else 0.0}

    def _epoch_iters(self, job) -> int:
        """train.epochs as iterations (MindSpeed-RL counts train_iters): prompts per epoch / global batch."""
        rows = len(prompt_rows(job)) if converts(job) else job.train.global_batch
        return max(int(job.train.epochs * max(rows // job.train.global_batch, 1)), 1)

    def render_config(self, shell, yml, context, job, run_dir: Path):
        context = dict(context, msrl=self._facts(context, job))
        return super().render_config(shell, yml, context, job, run_dir)

    def extra_files(self, context: dict[str, Any], job) -> dict[str, Any]:
        from ascendfactory.render import _environment

        context = dict(context, msrl=self._facts(context, job))
        name = context["msrl"]["model_name"]
        files: dict[str, Any] = {
            f"{MODEL_DIR}/{name}.yaml": _environment("yaml").get_template(self.model_template).render(context)}
        if converts(job):
            files[PROMPTS_FILE] = "".join(
                json.dumps({"prompt": r["prompt"][-1]["content"] if len(r["prompt"]) == 1 else r["prompt"],
                            "labels": r["reward_model"]["ground_truth"]}, ensure_ascii=False) + "\n"
                for r in prompt_rows(job))
        return files


def integrated(job) -> bool:
    """One colocated worker (rl_config.use_integrated_worker): the reference on the actor's layout, no
    critic and no reward model; else the roles get sections (and resources) of their own."""
    roles, rl = job.role_layouts(), job.rl
    return roles.get("reference") == roles.get("actor") and rl.critic is None and rl.reward.type != "model"


def _pipeline_problem(lay):
    """(key, message, hint) where backends.rl cannot run a layout's pipeline, else None."""
    if getattr(lay, "pp", 1) <= 1:
        return None
    for key, given in (("pp_layers", getattr(lay, "pp_layers", None)), ("vpp", (getattr(lay, "vpp", 1) or 1) > 1)):
        if given:
            return (key, "splits the layers evenly over the pipeline stages, one stage per rank (no "
                    "num_layer_list or virtual stages)", f"leave {key} out")
    if getattr(lay, "cp", 1) > 1:
        return "pp", "has no pipeline x context parallel RL actors", "set pp or cp to 1"
    return None


ADAPTER = MindSpeedRL()
