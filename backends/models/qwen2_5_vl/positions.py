"""Index arithmetic of Qwen2.5-VL, as pure functions of image_grid_thw (what transformers computes in
get_vision_position_ids / get_vision_window_index / Qwen2_5_VLModel.get_rope_index):

    vision_positions(grid_thw, merge)           (h, w) patch coordinates, merge-block major  [N, 2]
    vision_cu_seqlens(grid_thw)                 one attention document per image frame        [n+1]
    window_index(grid_thw, merge, window, patch) the patch-group order that makes each window
                                                contiguous, and the windows' cu_seqlens
    rope_index(input_ids, grid_thw, ...)        the text decoder's M-RoPE positions         [3, B, S]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def vision_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    out = []
    for t, h, w in _grids(grid_thw):
        hpos = torch.arange(h).unsqueeze(1).expand(h, w)
        wpos = torch.arange(w).unsqueeze(0).expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(1, 2).flatten()
        wpos = wpos.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def window_index(grid_thw: torch.Tensor, merge: int, window_size: int, patch_size: int):
    """(order [N/merge²] of the merged patch groups, cu_seqlens [windows+1] in patches)."""
    win = window_size // merge // patch_size
    unit = merge * merge
    order, cu, base = [], [0], 0
    for t, h, w in _grids(grid_thw):
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        ph, pw = win - gh % win, win - gw % win
        nh, nw = (gh + ph) // win, (gw + pw) // win
        padded = F.pad(index, (0, pw, 0, ph), value=-1)
        padded = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        sizes = (padded >= 0).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat >= 0] + base)
        for n in sizes.tolist():
            if n:  # empty windows (padding only) add no document
                cu.append(cu[-1] + n * unit)
        base += t * gh * gw
    return (torch.cat(order).to(grid_thw.device),
            torch.tensor(cu, dtype=torch.int32, device=grid_thw.device))


def image_token_counts(grid_thw: torch.Tensor, merge: int) -> list[int]:
    return [t * h * w // (merge * merge) for t, h, w in _grids(grid_thw)]


def rope_index(input_ids: torch.Tensor, grid_thw: torch.Tensor | None, image_token_id: int, merge: int,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE positions [3, B, S]: text tokens count up on all three rows; an image's tokens take
    (t, h, w) offsets from the position where it starts, and the text after it continues from
    start + max(h, w) (merged units). Padding (attention_mask 0) gets position 0. Images are taken in
    order over the batch; an image is its t·h·w/merge² consecutive image tokens."""
    b, s = input_ids.shape
    pos = torch.zeros(3, b, s, dtype=torch.long, device=input_ids.device)
    grids = _grids(grid_thw) if grid_thw is not None else []
    next_image = 0
    for row in range(b):
        keep = attention_mask[row].bool() if attention_mask is not None else torch.ones(s, dtype=torch.bool,
                                                                                          device=input_ids.device)
        ids = input_ids[row][keep].tolist()
        pieces, cur, i = [], 0, 0
        while i < len(ids):
            if ids[i] == image_token_id:
                if next_image >= len(grids):
                    raise ValueError(f"sample {row}: more image tokens than images in image_grid_thw")
                t, h, w = grids[next_image]
                next_image += 1
                gh, gw = h // merge, w // merge
                n = t * gh * gw
                tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).flatten()
                hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).flatten()
                ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).flatten()
                pieces.append(torch.stack([tt, hh, ww]) + cur)
                cur += max(gh, gw)
                i += n
            else:
                j = i
                while j < len(ids) and ids[j] != image_token_id:
                    j += 1
                pieces.append(torch.arange(cur, cur + j - i).view(1, -1).expand(3, -1))
                cur += j - i
                i = j
        if pieces:
            row_pos = torch.cat(pieces, dim=1).to(pos.device)
            if row_pos.shape[1] != len(ids):
                raise ValueError(f"sample {row}: an image's tokens run past the end of the sequence")
            pos[:, row, keep] = row_pos
    if next_image != len(grids):
        raise ValueError(f"image_grid_thw holds {len(grids)} images but the input ids have tokens for {next_image}")
    return pos


def rope_index_packed(ids: torch.Tensor, cu_seqlens: torch.Tensor, grid_thw: torch.Tensor | None,
                      image_token_id: int, merge: int) -> torch.Tensor:
    """rope_index of packed documents ids [T] (cu_seqlens [n+1]): each document's positions start at 0
    and it takes the next images of grid_thw that its image tokens hold. -> [3, 1, T]."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    counts = image_token_counts(grid_thw, merge) if grid_thw is not None else []
    out, used = [], 0
    for start, end in zip(cu[:-1], cu[1:]):
        doc = ids[start:end].unsqueeze(0)
        want, take = int((doc == image_token_id).sum()), 0
        while want > 0 and used + take < len(counts):
            want -= counts[used + take]
            take += 1
        if want != 0:
            raise ValueError(f"document {len(out)}: its image tokens do not add up to whole images of image_grid_thw")
        grids = grid_thw[used:used + take] if take else None
        out.append(rope_index(doc, grids, image_token_id, merge))
        used += take
    if used != len(counts):
        raise ValueError(f"image_grid_thw holds {len(counts)} images but the documents have tokens for {used}")
    return torch.cat(out, dim=2)
