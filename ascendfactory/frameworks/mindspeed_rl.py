"""MindSpeed-RL: RL with Megatron-style actors, the MindSpeed-RL YAML, backends.rl."""

from __future__ import annotations

from ascendfactory.frameworks.base import FeatureUse
from ascendfactory.frameworks.rl import RLAdapter, role_cp


class MindSpeedRL(RLAdapter):
    name = "mindspeed-rl"
    engine_module = "backends.rl"
    columns = {"methods": "list", "vllm": "version", "megatron_backend": "flag", "long_seq": "flag"}
    template = "engines/mindspeed-rl.yaml.j2"
    config_name = "mindspeed_rl.yaml"
    rollout_engines = ("vllm", "hf")

    def features_used(self, job, distributed):
        uses = self.role_features(job)
        uses.append(FeatureUse("megatron_backend", "the actor trains with the Megatron-style backend"))
        cp = role_cp(job)
        if cp > 1:
            uses.append(FeatureUse("long_seq", f"context parallel cp={cp}"))
        return uses


ADAPTER = MindSpeedRL()
