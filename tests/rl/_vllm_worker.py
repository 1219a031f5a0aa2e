"""Run in the vLLM environment (.venv-vllm) by test_rl_vllm.py: backends.rl.vllm_rollout against the
in-repo generator on the same weights, before and after an in-memory weight push. Writes a JSON report.

    python tests/rl/_vllm_worker.py MODEL_DIR OUT.json
"""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TEXTS = ["What is 3 + 4?", "Hello", "What is 96 * 12? Put the final answer after ####.", "12"]


def main(model_dir: str, out: str) -> None:
    import transformers

    from backends import kernels
    from backends.llm.models import from_pretrained
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
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.load(ours)
    report["after_load"] = dict(zip(("vllm", "ours"), both(max_new_tokens=16, temperature=0)))
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
