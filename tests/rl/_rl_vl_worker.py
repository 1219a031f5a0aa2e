"""Run the RL recipe on the tiny Qwen2.5-VL (examples/tiny-qwen2.5-vl) with image prompts, under torchrun
(or alone): argv[1] = JSON list of {"name", **RLConfig overrides} (train_files: a jsonl of VeRL rows),
argv[2] = output folder. Each case writes <name>.jsonl (metrics) and, from rank 0, <name>.params (the
sum and the sum of squares of the actor's parameters after the run)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from backends.common.distributed import init_runtime  # noqa: E402
from backends.common.trainer import Trainer  # noqa: E402
from backends.rl.config import RLConfig  # noqa: E402
from backends.rl.recipe import RLRecipe  # noqa: E402
from tests.helpers.dist_exit import leave  # noqa: E402

MODEL = ROOT / "examples" / "tiny-qwen2.5-vl"


def main():
    cases, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    rt = init_runtime("cpu")
    for case in cases:
        case = dict(case)
        name = case.pop("name")
        cfg = RLConfig(model_path=str(MODEL), metrics_file=str(out / f"{name}.jsonl"), **case)
        recipe = RLRecipe(cfg)
        Trainer(recipe, rt).run()
        params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
                  for p in recipe.parts["actor"].model.parameters()]
        params = [p.double() for p in params]
        if rt.rank == 0:
            from torch.distributed.fsdp import FSDPModule

            model = recipe.parts["actor"].model
            units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
            (out / f"{name}.units").write_text(json.dumps(units))
            names = [n for n, _ in model.named_parameters()]
            vision = [p for n, p in zip(names, params) if n.startswith("visual.")]
            (out / f"{name}.vision").write_text(json.dumps(sum(float((p * p).sum()) for p in vision)))
            (out / f"{name}.params").write_text(json.dumps([sum(float(p.sum()) for p in params),
                                                            sum(float((p * p).sum()) for p in params)]))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    leave()


if __name__ == "__main__":
    main()
