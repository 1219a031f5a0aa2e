"""Run the RL recipe on the tiny model for a few steps, once per case, under torchrun (or alone):
argv[1] = JSON list of {"name", "algorithm", **RLConfig overrides}, argv[2] = output folder. Each case
writes <name>.jsonl (metrics) and, from rank 0, <name>.params (the sum and the sum of squares of the
actor's parameters after the run). A case with "fsdp": true shards the actor, critic and reference; a
case with "file" (and "overrides") loads that job file instead (backends.rl.config.load)."""

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

MODEL = ROOT / "examples" / "tiny-qwen3"


def records(count: int = 32) -> list[dict]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    lines = (ROOT / "examples" / "data" / "arithmetic_prompts.jsonl").read_text().splitlines()[:count]
    rows = [json.loads(line) for line in lines]
    return [{"prompt_ids": tok(r["prompt"])["input_ids"], "ground_truth": r["answer"]} for r in rows]


def main():
    cases, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    rt = init_runtime("cpu")
    data = records()
    for case in cases:
        case = dict(case)
        name = case.pop("name")
        if "file" in case:  # a rendered job file (e.g. MindSpeed-RL's YAML) with dotted overrides, its sidecar beside it
            from backends.rl.config import load

            path = Path(case["file"])
            cfg = load(path, case.get("overrides", []), engine=path.parent / "engine.yaml")
            cfg.metrics_file = str(out / f"{name}.jsonl")
        else:
            cfg = RLConfig(model_path=str(MODEL), records=data, metrics_file=str(out / f"{name}.jsonl"), **case)
        recipe = RLRecipe(cfg)
        Trainer(recipe, rt).run()
        # whole tensors on every rank (an FSDP-sharded actor gathers each DTensor, collectively)
        params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
                  for p in recipe.parts["actor"].model.parameters()]
        params = [p.double() for p in params]
        if rt.rank == 0:
            (out / f"{name}.params").write_text(json.dumps([sum(float(p.sum()) for p in params),
                                                            sum(float((p * p).sum()) for p in params)]))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    leave()


if __name__ == "__main__":
    main()
