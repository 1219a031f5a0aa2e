"""backends.llm resumes at pp > 1 through the shared checkpoint: a tied Llama (the embedding on the first and
the last stage) at pp2 × dp2 with the distributed optimizer (Adam states sharded over dp within each stage)
resumed from its step-2 checkpoint takes steps 3-5 exactly as the uninterrupted run did.
(tests/mm/test_mm_resume.py holds the MindSpeed-MM engine; test_stage_resume.py the checkpoint itself.)"""

from __future__ import annotations

import torch

from tests.helpers.tiny_hf import TINY, make_tiny_hf
from tests.llm.test_engine_runs import final_weights, job, losses, run_job, torchrun


def test_llm_pp2_dp2_distributed_optimizer_resume_equals_uninterrupted(tmp_path):
    model = make_tiny_hf("llama", tmp_path / "model", num_hidden_layers=4)
    layout = {"parallel": {"pp": 2, "distributed_optimizer": True}, **torchrun(4)}

    def llama(out, **changes):
        return job(tmp_path / out, model=TINY["llama"][1], model_path=str(model), **layout, **changes)

    run_job(tmp_path, llama("straight", train={"save_interval": 2}), "straight.yaml")
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    run_job(tmp_path, llama("resumed", resume=str(step_2)), "resumed.yaml")
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert len(straight) == 5 and resumed == straight[2:], (resumed, straight)
    a, b = final_weights(tmp_path / "resumed"), final_weights(tmp_path / "straight")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
