"""VeRL: RL with FSDP actors (Ulysses sequence parallel), the ppo_trainer tree, backends.rl."""

from __future__ import annotations

from ascendfactory.frameworks.base import FeatureUse, fsdp_states
from ascendfactory.frameworks.rl import RLAdapter


class Verl(RLAdapter):
    name = "verl"
    engine_module = "backends.rl"
    columns = {"methods": "list", "sglang": "version", "vllm": "version", "train_backend": "version"}
    template = "engines/verl.yaml.j2"
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
        return out

    def features_used(self, job, distributed):
        return self.role_features(job) + [FeatureUse("train_backend", "the actor trains with FSDP")]

    def states(self, job, on_device, trainable, layer_only, c, dp):
        return fsdp_states(job, on_device, trainable, layer_only, c, dp)

    def shards_frozen_copies(self, job):
        return True

    def probe(self, job, row, feature, stage):
        super().probe(job, row, feature, stage)
        job["parallel"]["fsdp"] = True


ADAPTER = Verl()
