"""Run the RL recipe on the tiny Qwen2.5-VL (examples/tiny-qwen2.5-vl) with image prompts, under torchrun
(or alone): argv[1] = JSON list of {"name", **RLConfig overrides} (train_files: a jsonl of VeRL rows),
argv[2] = output folder. Each case writes what _rl_run_worker.py's do (<name>.jsonl, <name>.params) and,
from rank 0, <name>.units (the actor's FSDP-wrapped modules) and <name>.vision (the sum of squares of the
vision tower's parameters after the run)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.rl.config import RLConfig  # noqa: E402
from tests.rl import _rl_run_worker  # noqa: E402

MODEL = ROOT / "examples" / "tiny-qwen2.5-vl"


def vl_config(case: dict, metrics_file: Path) -> RLConfig:
    return RLConfig(model_path=str(MODEL), metrics_file=str(metrics_file), **case)


def record_units_and_vision(out: Path, name: str, model, params: list) -> None:
    from torch.distributed.fsdp import FSDPModule

    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    (out / f"{name}.units").write_text(json.dumps(units))
    names = [n for n, _ in model.named_parameters()]
    vision = [p for n, p in zip(names, params) if n.startswith("visual.")]
    (out / f"{name}.vision").write_text(json.dumps(sum(float((p * p).sum()) for p in vision)))


if __name__ == "__main__":
    _rl_run_worker.main(vl_config, record_units_and_vision)
