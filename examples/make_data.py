"""Write the small bundled datasets under examples/data/ (deterministic; rerun to regenerate).

Arithmetic Q&A in every format the job spec knows: alpaca, sharegpt, text, pairwise, prompt; and
counting questions on the bundled shape images (VL RL prompts).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"


def _problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b}", value


def main(n: int = 512, seed: int = 0) -> None:
    rng = random.Random(seed)
    OUT.mkdir(parents=True, exist_ok=True)
    alpaca, sharegpt, text, pairs, prompts = [], [], [], [], []
    for i in range(n):
        expr, value = _problem(rng)
        question = f"What is {expr}?"
        answer = f"{expr} = {value}. The answer is {value}."
        alpaca.append({"instruction": question, "input": "", "output": answer})
        sharegpt.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer},
                                           {"from": "human", "value": "And doubled?"},
                                           {"from": "gpt", "value": f"2 * {value} = {2 * value}."}]})
        text.append({"text": f"{question} {answer}"})
        wrong = value + rng.choice([-10, -1, 1, 10])
        pairs.append({"instruction": question, "input": "", "chosen": answer,
                      "rejected": f"{expr} = {wrong}. The answer is {wrong}."})
        if i < n // 4:
            prompts.append({"prompt": f"{question} Put the final answer after ####.", "answer": str(value)})
    (OUT / "arithmetic_alpaca.json").write_text(json.dumps(alpaca, indent=0) + "\n")
    (OUT / "arithmetic_sharegpt.json").write_text(json.dumps(sharegpt, indent=0) + "\n")
    (OUT / "arithmetic_pairs.json").write_text(json.dumps(pairs, indent=0) + "\n")
    (OUT / "arithmetic_corpus.jsonl").write_text("".join(json.dumps(t) + "\n" for t in text))
    (OUT / "arithmetic_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (OUT / "vl_count_prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in vl_count_prompts()))


def vl_count_prompts(count: int = 32) -> list[dict]:
    """Image-prompt RL data (examples/verl/grpo-vl.yaml): two of the shape images make_tiny_vl_model.py draws
    (data/images/<colour>_<shape>_<k>.png) per prompt, the answer how many of them show a circle."""
    import itertools

    names = sorted(f"{c}_{s}_{k}.png" for c in ("red", "green", "blue", "yellow") for s in ("circle", "square")
                   for k in (0, 1))
    rows = []
    for a, b in itertools.islice(itertools.combinations(names, 2), count):
        rows.append({"prompt": [{"role": "user", "content": "<image><image>How many of the two pictures show a "
                                 "circle? End with #### and the number."}],
                     "images": [f"images/{a}", f"images/{b}"], "answer": str(sum("circle" in x for x in (a, b)))})
    return rows


if __name__ == "__main__":
    main()
