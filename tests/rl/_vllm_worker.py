"""Run in the vLLM environment (.venv-vllm) by test_rl_vllm.py: backends.rl.vllm_rollout against the
in-repo generator on the same weights, before and after an in-memory weight push. Writes a JSON report.

    python tests/rl/_vllm_worker.py MODEL_DIR OUT.json         # a text model
    python tests/rl/_vllm_worker.py --vl MODEL_DIR OUT.json    # a Qwen2.5-VL model, image prompts
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TEXTS = ["What is 3 + 4?", "Hello", "What is 96 * 12? Put the final answer after ####.", "12"]
IMAGES = ROOT / "examples" / "data" / "images"
# VeRL-style rows: two images, one image, none; the images differ in size (48 px files, resized by the processor)
VL_ROWS = [(["red_circle_0.png", "blue_square_1.png"], "<image><image>Which colours?"),
           (["green_square_0.png"], "What colour is the <image> shape?"),
           ([], "What is 3 + 4?")]


def perturb(model) -> None:
    """Change every weight, as an update does."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def main(model_dir: str, out: str) -> None:
    import transformers

    from backends import kernels
    from backends.models.decoder import from_pretrained
    from backends.rl.rollout import generate
    from backends.rl.vllm_rollout import VllmRollout

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    engine = VllmRollout(model_dir, dtype="float32", max_model_len=128, seed=0)
    report = {}

    def both(**kw):
        return engine.generate(prompts, **kw)[0], generate(ours, prompts, **kw)

    got, want = both(max_new_tokens=16, temperature=0)
    report["greedy"] = {"vllm": got, "ours": want}
    eos = [want[0][5], 511]  # a token greedy emits mid-answer: both stop right after it, keeping it
    report["eos"] = dict(zip(("vllm", "ours"), both(max_new_tokens=16, temperature=0, eos_token_id=eos)))
    stop = tok.decode(want[2][3:6])
    got = engine.generate(prompts, max_new_tokens=16, temperature=0, stop=[stop])[0]
    report["stop"] = {"vllm": got, "ours": generate(ours, prompts, max_new_tokens=16, temperature=0, stop=[stop],
                                                    decode=tok.decode), "string": stop}
    # seeded per prompt: the last two prompts' samples are the same alone as in the full batch
    full, logp = engine.generate(prompts, max_new_tokens=12, n=3, seed=5, prompt_ids=[10, 11, 12, 13])
    part, _ = engine.generate(prompts[2:], max_new_tokens=12, n=3, seed=5, prompt_ids=[12, 13])
    report["sampled"] = {"full": full, "part": part}
    diffs = []
    with torch.no_grad():
        for i, (sample, lp) in enumerate(zip(full, logp)):
            prompt = prompts[i // 3]
            hidden = ours(torch.tensor([prompt + sample]), return_hidden=True)[0]
            picked = hidden[len(prompt) - 1:len(prompt) - 1 + len(sample)]
            mine, _ = kernels.linear_logprobs(picked, ours.output_weight(), torch.tensor(sample))
            diffs.append(float((mine - torch.tensor(lp)).abs().max()))
    report["logprob_diff_max"] = max(diffs)
    # the weights change (as an update does); pushed in memory, vLLM's greedy output follows them
    perturb(ours)
    engine.load(ours)
    report["after_load"] = dict(zip(("vllm", "ours"), both(max_new_tokens=16, temperature=0)))
    Path(out).write_text(json.dumps(report))


def main_vl(model_dir: str, out: str) -> None:
    """Image prompts: vLLM (its own processing of the images) against the in-repo generator on the records
    backends.rl.multimodal made, greedy and sampled, before and after a weight push."""
    import transformers

    from backends import kernels
    from backends.rl import multimodal
    from backends.rl.rollout import generate
    from backends.rl.vllm_rollout import VllmRollout

    rows = Path(out).with_suffix(".jsonl")
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": text}],
                                        "images": [str(IMAGES / f) for f in files],
                                        "reward_model": {"ground_truth": "x"}}) + "\n" for files, text in VL_ROWS))
    cfg = SimpleNamespace(model_path=model_dir, train_files=[str(rows)], prompt_key="prompt", image_key="images",
                          reward_fn_key="data_source", max_prompt_length=256, filter_overlong_prompts=False,
                          max_samples=None)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    records = multimodal.load_records(cfg, tok)
    ours = multimodal.from_pretrained(model_dir)
    vision = multimodal.Vision(ours.config, records)
    index = list(range(len(records)))
    prompts = [r["prompt_ids"] for r in records]
    engine = VllmRollout(model_dir, dtype="float32", max_model_len=320, seed=0, images_per_prompt=vision.most_images())
    report = {"image_tokens": [sum(t == vision.image_id for t in p) for p in prompts]}

    def logprob_diff(samples, logps, n):
        diffs = []
        with torch.no_grad():
            for i, (sample, lp) in enumerate(zip(samples, logps)):
                k = i // n
                ids = torch.tensor([prompts[k] + sample])
                hidden = ours(ids, return_hidden=True, **vision.batch([k], ids, [len(prompts[k])]))[0]
                picked = hidden[len(prompts[k]) - 1:len(prompts[k]) - 1 + len(sample)]
                mine, _ = kernels.linear_logprobs(picked, ours.output_weight(), torch.tensor(sample))
                diffs.append(float((mine - torch.tensor(lp)).abs().max()))
        return max(diffs)

    def round_(name):
        got = engine.generate(vision.engine_prompts(index), max_new_tokens=12, temperature=0)[0]
        want = generate(ours, prompts, max_new_tokens=12, temperature=0, vision=vision.prompts(index))
        sampled, logp = engine.generate(vision.engine_prompts(index), max_new_tokens=10, n=2, seed=3)
        report[name] = {"vllm": got, "ours": want, "logprob_diff_max": logprob_diff(sampled, logp, 2)}

    round_("greedy")
    perturb(ours)
    engine.load(ours)
    round_("after_load")
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1] == "--vl":
        main_vl(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
