"""VeRL 0.9.1's validation (ray_trainer._validate): before the first step (trainer.val_before_train), every
test_freq steps and after the last one, the validation prompts (data.val_files) are rolled out with
rollout.val_kwargs (n responses each; do_sample false: greedy), scored by the training's scorer, and
reduced by VeRL's process_validation_metrics into `val-core/<data_source>/<var>/mean@<n>` and
`val-aux/...` (std@, best@/worst@ bootstraps, maj@ when the reward gives a `pred`).

The prompts of each val_batch_size batch are padded to a multiple of the data-parallel size by
repeating its first ones (VeRL's pad_dataproto_to_divisor), shared contiguously over the dp ranks,
scored there and gathered in order, so every rank computes the same metrics. Each response samples
from its own stream seeded by (the step, its prompt's index, its number): the training's random
streams and data position are untouched, and the prompts' order or batching changes no response.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

# VeRL's single-turn agent loop counts a prompt and its response as 2 turns (val-aux/num_turns/*)
SINGLE_TURN = 2
_SEED_SALT = 0x5EED_7A1  # validation streams apart from the training rollout's (seed*7919 + step*131 + round)


# ---------------------------------------------------------------------- VeRL's metric_utils, line by line


def bootstrap_metric(data: list, subset_size: int, reduce_fns: list, n_bootstrap: int = 1000,
                     seed: int = 42) -> list[tuple[float, float]]:
    """(mean, std) of each reduce_fn over n_bootstrap subsets drawn with replacement. VeRL seeds numpy's global
    generator; its RandomState(seed) draws the same indices without touching the global one."""
    rng = np.random.RandomState(seed)
    data_np = np.array(data, dtype=object)
    idxs = rng.choice(len(data_np), size=(n_bootstrap, subset_size), replace=True)
    results = np.empty((len(reduce_fns), n_bootstrap), dtype=np.float64)
    for f, fn in enumerate(reduce_fns):
        for b in range(n_bootstrap):
            results[f, b] = fn(data_np[idxs[b]])
    return [(float(np.mean(results[f])), float(np.std(results[f]))) for f in range(len(reduce_fns))]


def calc_maj_val(data: list[dict], vote_key: str, val_key: str) -> float:
    """The value of the first sample voting for the most common vote (ties: the vote seen first)."""
    vote2vals: dict[Any, list] = defaultdict(list)
    for d in data:
        vote2vals[d[vote_key]].append(d[val_key])
    counts = {k: len(v) for k, v in vote2vals.items()}
    return vote2vals[max(counts, key=counts.get)][0]


def _ns(n_resps: int) -> list[int]:
    """2, 4, 8, ... below n_resps, then n_resps."""
    if n_resps <= 1:
        return []
    ns, n = [], 2
    while n < n_resps:
        ns.append(n)
        n *= 2
    return ns + [n_resps]


def process_validation_metrics(data_sources: list[str], sample_uids: list[str], infos: dict[str, list],
                               seed: int = 42) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {var: {metric: value}}}: per prompt (uid) mean@n, std@n and the best / worst (maj with a
    `pred`) bootstraps over 2, 4, ..., n responses, then averaged over the prompts of the data source."""
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, source in enumerate(data_sources):
        for var, vals in infos.items():
            grouped[source][sample_uids[i]][var].append(vals[i])
    per_uid: dict = {}
    for source, uid2vars in grouped.items():
        by_uid = per_uid.setdefault(source, {})
        for uid, var2vals in uid2vars.items():
            preds = var2vals.get("pred")
            out = by_uid.setdefault(uid, {})
            for var, vals in var2vals.items():
                vals = [v for v in vals if v is not None]
                if not vals or isinstance(vals[0], str):
                    continue
                has_pred = preds is not None and len(preds) == len(vals) and all(p is not None for p in preds)
                n_resps = len(vals)
                metric = {f"mean@{n_resps}": float(np.mean(vals))}
                if n_resps > 1:
                    metric[f"std@{n_resps}"] = float(np.std(vals))
                    for n in _ns(n_resps):
                        (bon_mean, bon_std), (won_mean, won_std) = bootstrap_metric(vals, n, [np.max, np.min],
                                                                                    seed=seed)
                        metric[f"best@{n}/mean"], metric[f"best@{n}/std"] = bon_mean, bon_std
                        metric[f"worst@{n}/mean"], metric[f"worst@{n}/std"] = won_mean, won_std
                        if has_pred:
                            votes = [{"val": v, "pred": p} for v, p in zip(vals, preds)]
                            [(maj_mean, maj_std)] = bootstrap_metric(
                                votes, n, [partial(calc_maj_val, vote_key="pred", val_key="val")], seed=seed)
                            metric[f"maj@{n}/mean"], metric[f"maj@{n}/std"] = maj_mean, maj_std
                out[var] = metric
    result: dict = defaultdict(lambda: defaultdict(dict))
    for source, by_uid in per_uid.items():
        collected: dict = defaultdict(lambda: defaultdict(list))
        for var2metric in by_uid.values():
            for var, metric in var2metric.items():
                for name, value in metric.items():
                    collected[var][name].append(value)
        for var, name2vals in collected.items():
            for name, vals in name2vals.items():
                result[source][var][name] = float(np.mean(vals))
    return result


def metric_names(data_sources: list[str], sample_uids: list[str], infos: dict[str, list],
                 turns: list[int] | None = None) -> dict[str, float]:
    """ray_trainer._val_metrics_update: val-core for the core variable's (acc if any, else reward) mean / maj /
    best at the largest n, val-aux for the rest; num_turns min / max / mean."""
    out: dict[str, float] = {}
    for source, var2metric in process_validation_metrics(data_sources, sample_uids, infos).items():
        core = "acc" if "acc" in var2metric else "reward"
        for var, metric in var2metric.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric)
            for name, value in metric.items():
                is_core = var == core and any(name.startswith(p) for p in ("mean", "maj", "best")) \
                    and f"@{n_max}" in name
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = value
    if turns:
        out["val-aux/num_turns/min"] = float(min(turns))
        out["val-aux/num_turns/max"] = float(max(turns))
        out["val-aux/num_turns/mean"] = float(np.mean(turns))
    return out


# ---------------------------------------------------------------------- the run


def _score(recipe, texts: list[str], lengths: list[int], records: list[dict]) -> list[dict]:
    """Each response's reward infos as VeRL's naive / dapo reward manager gives them (Scorer.with_infos)."""
    c = recipe.cfg
    return recipe.scorer.with_infos(texts, [r.get("ground_truth") for r in records], lengths,
                                    [r.get("data_source", "") for r in records], log_overlong=c.overlong_log)[2]


def run(recipe, step: int) -> dict[str, float]:
    """One validation at `step` (steps done) on every rank -> VeRL's val metrics (the same on every rank)."""
    import torch.distributed as dist

    c = recipe.cfg
    records = c.val_records
    batch = c.val_batch_size or len(records)
    dp, rank = recipe.gen_dp, recipe.gen_rank  # the generating ranks (the dp ranks, or VeRL's rollout replicas)
    seed = (c.seed * 7919 + step * 131) ^ _SEED_SALT
    samples: list[dict] = []  # per response, in VeRL's order: prompt by prompt, its n responses together
    for start in range(0, len(records), batch):
        index = list(range(start, min(start + batch, len(records))))
        padded = index + index[:(-len(index)) % dp]  # VeRL pads by repeating the batch's first prompts
        share = len(padded) // dp
        mine = padded[rank * share:(rank + 1) * share]
        greedy = not c.val_do_sample
        out, _ = recipe.generate([records[i]["prompt_ids"] for i in mine], mine, seed, rows=None, n=c.val_n,
                                 temperature=0.0 if greedy else c.val_temperature,
                                 top_p=1.0 if greedy else c.val_top_p, top_k=0 if greedy else c.val_top_k)
        texts = [recipe.tokenizer.decode(r, skip_special_tokens=True) for r in out]
        rows = [records[i] for i in mine for _ in range(c.val_n)]
        infos = _score(recipe, texts, [len(r) for r in out], rows)
        local = [{"prompt": i, "output": t, "infos": f} for i, t, f in
                 zip([i for i in mine for _ in range(c.val_n)], texts, infos)]
        if dp > 1:
            parts: list = [None] * dp
            dist.all_gather_object(parts, local, group=recipe.gen_group)
            local = [s for part in parts for s in part]
        samples += local[:len(index) * c.val_n]  # the padding's responses dropped
    keys = list(samples[0]["infos"])  # VeRL takes the first response's keys
    infos = {k: [s["infos"][k] for s in samples] for k in keys}
    sources = [records[s["prompt"]].get("metric_source", "unknown") for s in samples]
    uids = [s["prompt"] for s in samples]
    if c.val_dump_dir and recipe.rt.is_main:
        _dump(c.val_dump_dir, step, recipe.tokenizer, records, samples, infos)
    return metric_names(sources, uids, infos, turns=[SINGLE_TURN] * len(samples))


def _dump(folder: str, step: int, tokenizer, records: list[dict], samples: list[dict], infos: dict) -> None:
    """trainer.validation_data_dir: <step>.jsonl, one line per response (input, output, gts, score, step, the
    reward infos), as VeRL's _dump_generations writes it."""
    rows = []
    for i, s in enumerate(samples):
        record = records[s["prompt"]]
        entry = {"input": tokenizer.decode(record["prompt_ids"], skip_special_tokens=True), "output": s["output"],
                 "gts": record.get("ground_truth"), "score": infos["reward"][i], "step": step}
        entry.update({k: v[i] for k, v in infos.items()})
        rows.append(entry)
    write_generations(folder, step, rows)


def write_generations(folder: str, step: int, rows: list[dict]) -> None:
    """VeRL's _write_generations: <folder>/<step>.jsonl, one JSON object a line."""
    path = Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    with (path / f"{step}.jsonl").open("w", encoding="utf-8") as fh:
        for entry in rows:
            fh.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")
