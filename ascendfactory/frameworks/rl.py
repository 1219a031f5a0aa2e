"""What the two RL frameworks share: the RL stages, method cells, the rollout engine cell and its
probe. Each RL job trains an actor (and for ppo a critic) next to a reference model, a rollout
engine and a reward; their layouts are in the job's `rl.<role>.parallel` blocks."""

from __future__ import annotations

from typing import Any

from ascendfactory.frameworks.base import Adapter, FeatureUse

RL_STAGES = ("grpo", "dapo", "ppo")
TRAINED_ROLES = ("actor", "critic")


class RLAdapter(Adapter):
    stages = RL_STAGES
    rollout_engines: tuple[str, ...] = ("vllm", "sglang", "hf")

    def common_limits(self, job, serving):
        out = super().common_limits(job, serving)
        engine = job.rl.rollout.engine if job.rl else None
        if engine is not None and engine not in self.rollout_engines:
            out.append(self.refuse("rl.rollout.engine", f"rolls out with {' or '.join(self.rollout_engines)}, "
                                   f"not {engine}", f"set rl.rollout.engine: {self.rollout_engines[0]}"))
        return out

    def role_features(self, job) -> list[FeatureUse]:
        uses = []
        if job.stage in self.stages:
            uses.append(FeatureUse("methods", f"stage: {job.stage}", needs=job.stage))
        engine = job.rl.rollout.engine if job.rl else "vllm"
        if engine in self.columns:  # the inference engines with a column (hf generation has none)
            uses.append(FeatureUse(engine, f"rl.rollout.engine: {engine}"))
        return uses

    def serves(self, row, stage):
        return stage in (row["methods"] if isinstance(row.get("methods"), list) else [])

    def no_effect(self, job):
        out = {"data.packing": "RL micro-batches are the rollouts' rows, padded to their longest (packing them "
                               "changes speed, not the loss)",
               "data.dynamic_seq_len": "RL micro-batches are padded to their longest row already",
               "data.pad_to_multiple_of": "a padding multiple changes speed, not the loss, and backends.rl pads "
                                          "to the longest row",
               "kernels.fused_ops": "backends.rl picks its fused kernels itself (fused ops change speed, not the "
                                    "loss)",
               "train.log_interval": "backends.rl logs every step"}
        if job.stage != "dapo":
            out["rl.max_gen_rounds"] = f"only DAPO rolls out more rounds (stage {job.stage} keeps every group)"
        return out

    def plan_problems(self, job, arch):
        out = super().plan_problems(job, arch)
        if "schedule" in job.train.model_fields_set and job.train.schedule != "constant":  # given, not defaulted
            out.append(self.refuse("train.schedule", f"runs backends.rl, which trains at a constant learning rate "
                                   f"after warm-up ({job.train.schedule} decay is not built)",
                                   "set train.schedule: constant (or leave it out)"))
        return out

    def rl_batch_rules(self, job, world: int, role: str = "actor") -> dict[str, Any]:
        """This framework's own batch rules for backends.contract.layout.rl_batches (who, micro_share, world,
        rollout_dp, ref_dp, ref_micro) on a trained role's update (actor or critic); none beyond the
        engine's by default."""
        return {}

    def probe(self, job, row, feature, stage):
        job["stage"] = stage or row["methods"][0]
        job["data"]["format"] = "prompt"
        job["rl"] = {"rollout": {"engine": feature if feature in self.rollout_engines else "vllm"}}


def role_cp(job) -> int:
    """The largest context-parallel size of the roles that run the policy or critic forward."""
    layouts = [job.parallel] + [lay for _, lay in job.role_layouts().items()]
    return max(getattr(lay, "cp", 1) for lay in layouts)
