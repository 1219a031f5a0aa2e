"""Run the RL recipe on the tiny model for a few steps, once per case, under torchrun (or alone):
argv[1] = JSON list of {"name", "algorithm", **RLConfig overrides}, argv[2] = output folder. Each case
writes <name>.jsonl (metrics) and, from rank 0, <name>.params (the sum and the sum of squares of the
actor's parameters after the run). A case with "fsdp": true shards the actor, critic and reference; a
case with "file" (and "overrides") loads that job file instead (backends.rl.dialects.load). Another worker
(_rl_vl_worker.py) runs main() with its own config and extra files."""

import functools
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


@functools.cache  # one tokenization per process, shared by its cases
def records(count: int = 32) -> list[dict]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    lines = (ROOT / "examples" / "data" / "arithmetic_prompts.jsonl").read_text().splitlines()[:count]
    rows = [json.loads(line) for line in lines]
    return [{"prompt_ids": tok(r["prompt"])["input_ids"], "ground_truth": r["answer"]} for r in rows]


def tiny_config(case: dict, metrics_file: Path) -> RLConfig:
    """The tiny Qwen3 on the arithmetic prompts with the case's RLConfig keys, or the case's job file."""
    if "file" in case:  # a rendered job file (e.g. MindSpeed-RL's YAML) with dotted overrides, its sidecar beside it
        from backends.rl.dialects import load

        path = Path(case["file"])
        cfg = load(path, case.get("overrides", []), engine=path.parent / "engine.yaml")
        cfg.metrics_file = str(metrics_file)
        return cfg
    return RLConfig(model_path=str(MODEL), records=records(), metrics_file=str(metrics_file), **case)


def main(config=tiny_config, record=None):
    """Each case of argv[1] trained by config(case, its metrics file); rank 0 writes <name>.params and, with
    `record`, record(out, name, actor model, its whole float64 parameters) more files."""
    cases, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    rt = init_runtime("cpu")
    for case in cases:
        case = dict(case)
        name = case.pop("name")
        recipe = RLRecipe(config(case, out / f"{name}.jsonl"))
        Trainer(recipe, rt).run()
        model = recipe.parts["actor"].model
        # whole tensors on every rank (an FSDP-sharded actor gathers each DTensor, collectively)
        params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
        params = [p.double() for p in params]
        if rt.rank == 0:
            if record is not None:
                record(out, name, model, params)
            (out / f"{name}.params").write_text(json.dumps([sum(float(p.sum()) for p in params),
                                                            sum(float((p * p).sum()) for p in params)]))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    leave()


if __name__ == "__main__":
    main()
