"""What backends.mm implements, by (framework, feature, family); read by `ascendfactory matrix check`.

Imports only backends.contract. Declared only what a test proves:
- pretrain_full (qwen2_5_vl): the native model's logits equal transformers' (tests/mm/test_mm_model.py), and
  the pt / sft examples train through `ascendfactory run` with the loss falling, resume and export
  (tests/mm/test_mm_runs.py).
- distributed_optimizer (qwen2_5_vl): dp2 with the Adam states sharded over dp equals one process, losses and
  exported weights within 1e-4, with half the optimizer state per rank (tests/mm/test_mm_parallel.py, which
  also proves plain data parallel, DDP, against one process).
- recompute (qwen2_5_vl): full (uniform / block) and selective, per part (vision encoder, text decoder; model.json
  keys, else the Megatron flags): loss and gradients equal, fewer bytes saved for backward
  (tests/mm/test_mm_recompute.py); through `ascendfactory run` the losses equal one process (test_mm_parallel.py).
- sptd (qwen2_5_vl): data parallel (dp2), tensor parallel with sequence parallel on the text decoder, the vision
  tower's blocks and the merger's MLP (tp2; tp2 + SP × dp2 with the distributed optimizer) and pipeline parallel
  over the parts as model.json's pipeline_num_layers splits them, vision first (pp2 as rendered, the vision tower
  on the first stage; pp2 × dp2 with full recompute and the distributed optimizer with the vision tower across
  both stages) equal one process, losses and exported weights within 1e-4 (tests/mm/test_mm_parallel.py; tp2 +
  SP × pp2 with the vision tower across both stages under the slow marker). A split that puts text layers before
  the last vision layer's stage, or leaves a stage empty, is refused by name.
"""

from backends.contract import refusals

IMPLEMENTS = {
    "mindspeed-mm": {
        "pretrain_full": ["qwen2_5_vl"],
        "distributed_optimizer": ["qwen2_5_vl"],
        "recompute": ["qwen2_5_vl"],
        "sptd": ["qwen2_5_vl"],
    },
}

PENDING: dict[str, dict[str, str]] = {"mindspeed-mm": {}}

LIMITS: dict[str, dict[str, int]] = {"mindspeed-mm": {}}

UNBUILT: dict[str, list[tuple[dict[str, object], str]]] = {"mindspeed-mm": []}


def unbuilt(framework: str, fields: dict[str, object]) -> list[str]:
    """The UNBUILT reasons that `fields` (dotted job field -> value) trigger, each naming its settings."""
    return refusals.unbuilt(UNBUILT.get(framework, []), fields)
