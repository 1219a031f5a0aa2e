"""How one step's responses are laid out: the rollouts of a step as padded device tensors, its mini-batches
of whole prompt groups and each data-parallel rank's share of them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from backends.common.distributed import all_gather_padded

INTEGER_EXTRAS = ("record",)  # per-response extras that are indices, not numbers


@dataclass
class Rollouts:
    """A step's responses on the device, grouped by prompt (n consecutive rows per group): prompts [N, P] and
    responses [N, R] right-padded with 0 with their lengths; scores [N]; groups [N], the global group index (the
    training order). extra: per-response [N] or per-token [N, R] tensors (the reward's parts, each response's
    record, the rollout engine's log-probs; the step adds its passes' log-probs, values and advantages)."""
    prompts: torch.Tensor
    prompt_lens: torch.Tensor
    responses: torch.Tensor
    response_lens: torch.Tensor
    scores: torch.Tensor
    groups: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def pack(cls, prompts: list[list[int]], responses: list[list[int]], scores: list[float], groups: list[int],
             extra: dict[str, list], device) -> "Rollouts":
        """From the generator's and the scorer's lists (one entry per response; a list entry is per token)."""
        def column(key: str, values: list) -> torch.Tensor:
            if values and isinstance(values[0], (list, tuple)):
                return pad(values, width=out.responses.shape[1], dtype=torch.float32).to(device)
            dtype = torch.long if key in INTEGER_EXTRAS else torch.float64
            return torch.tensor(values, dtype=dtype, device=device)

        out = cls(pad(prompts).to(device), lengths(prompts, device), pad(responses).to(device),
                  lengths(responses, device), torch.tensor(scores, dtype=torch.float64, device=device),
                  torch.tensor(groups, dtype=torch.long, device=device))
        out.extra = {k: column(k, v) for k, v in extra.items()}
        return out

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"prompts": self.prompts, "prompt_lens": self.prompt_lens, "responses": self.responses,
                "response_lens": self.response_lens, "scores": self.scores, "groups": self.groups,
                **{f"extra.{k}": v for k, v in self.extra.items()}}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "Rollouts":
        return cls(**{k: v for k, v in t.items() if not k.startswith("extra.")},
                   extra={k[len("extra."):]: v for k, v in t.items() if k.startswith("extra.")})

    def select(self, rows: torch.Tensor) -> "Rollouts":
        """The rows an index or a boolean mask picks."""
        return Rollouts.from_tensors({k: v[rows] for k, v in self.tensors().items()})

    def gather(self, group) -> "Rollouts":
        """Every rank's rollouts of `group` in group-rank order (ragged widths padded to the widest rank's)."""
        return Rollouts.from_tensors({k: all_gather_padded(v, group) for k, v in self.tensors().items()})

    @staticmethod
    def cat(parts: list["Rollouts"]) -> "Rollouts":
        keys = parts[0].tensors()
        return Rollouts.from_tensors({k: cat_padded([p.tensors()[k] for p in parts]) for k in keys})

    def response_mask(self, rows=slice(None), width: int | None = None) -> torch.Tensor:
        """[rows, width] True on each response's tokens (width: the responses' width)."""
        width = self.responses.shape[1] if width is None else width
        return torch.arange(width, device=self.responses.device)[None] < self.response_lens[rows][:, None]

    def with_groups(self, first: int, n: int) -> "Rollouts":
        """Group indices first, first + 1, ... for its n-row groups."""
        groups = first + torch.arange(len(self), device=self.groups.device) // n
        return replace(self, groups=groups)


def step_metrics(kept: Rollouts, scores: list[torch.Tensor], rounds: int, groups: int) -> dict[str, float]:
    """A step's rollout metrics: the rewards of every response generated (`scores`, each round's), the band of the
    batch, the kept batch's verifier score and response length, the rounds and the groups kept."""
    every = torch.cat(scores)
    rows = max(len(kept), 1)
    return {"reward_mean": float(every.sum()) / max(len(every), 1),
            "reward_min": float(every.min()), "reward_max": float(every.max()),
            "score_mean": float(kept.extra["score"].sum()) / rows,
            "response_length_mean": float(kept.response_lens.sum()) / rows,
            "gen_rounds": float(rounds), "kept_groups": float(groups)}


def pad(rows: list[list], value=0, width: int | None = None, dtype=torch.long) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), max(width, 1)), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


def lengths(rows: list[list], device) -> torch.Tensor:
    return torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)


def cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of several tensors, the 2-D ones right-padded with 0 to the widest."""
    if parts[0].dim() == 2:
        width = max(p.shape[1] for p in parts)
        parts = [F.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(parts)


PER_TOKEN = ("old_logp", "ref_logp", "values", "advantages", "returns")  # what a step adds, [N, R] each


def micro_batch(r: Rollouts, rows: list[int], vision=None) -> dict:
    """A micro-batch of rollout rows: prompt + response right-padded to the longest, the response tensors [b, R]
    (R: the longest response) with their mask, and the step's per-token results so far; `vision`
    (multimodal.Vision) adds each record's images, placeholders and M-RoPE positions."""
    index = torch.tensor(rows, dtype=torch.long, device=r.responses.device)
    plen, rlen = r.prompt_lens[index], r.response_lens[index]
    width, total = int(rlen.max()), int((plen + rlen).max())
    cols = torch.arange(max(total, 1), device=index.device)[None]
    prompt = r.prompts[index].gather(1, cols.clamp(max=r.prompts.shape[1] - 1).expand(len(rows), -1))
    response = r.responses[index].gather(1, (cols - plen[:, None]).clamp(0, r.responses.shape[1] - 1))
    seq = torch.where(cols < plen[:, None], prompt, response) * (cols < (plen + rlen)[:, None])
    mask = r.response_mask(index, width)
    steps = torch.arange(width, device=index.device)[None]
    # the hidden state at position len(prompt) + j - 1 predicts response token j
    mb = {"input_ids": seq, "mask": mask, "responses": r.responses[index, :width],
          "pred": torch.where(mask, steps + plen[:, None] - 1, 0)}
    mb.update({k: r.extra[k][index, :width] for k in PER_TOKEN if k in r.extra})
    if vision is not None:
        mb["vision"] = vision.batch(r.extra["record"][index].tolist(), seq, plen.tolist())
    mb["n_tokens"] = int(rlen.sum())
    mb["n_positions"] = int((plen + rlen).sum())
    return mb


def mini_batches(groups: list[int], mini_batch_size: int, world: int) -> list[list[int]]:
    """Rows (responses) of each mini-batch of mini_batch_size groups, in global order; a last mini-batch
    with fewer responses than ranks joins the one before it."""
    n_groups = max(groups, default=-1) + 1
    out = [[i for i, g in enumerate(groups) if first <= g < first + mini_batch_size]
           for first in range(0, n_groups, mini_batch_size)]
    if len(out) > 1 and len(out[-1]) < world:
        out[-2] += out.pop()
    return [rows for rows in out if len(rows) >= world]


def share(rows: list[int], world: int, rank: int) -> list[int]:
    """A rank's contiguous slice of a mini-batch's rows (near-equal slices, rank order)."""
    base, extra = divmod(len(rows), world)
    start = rank * base + min(rank, extra)
    return rows[start:start + base + (rank < extra)]
