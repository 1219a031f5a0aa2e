"""Reading only a region of a checkpoint tensor, through the transformations a model applies to it.

A rank that keeps a shard of a parameter (tensor parallel, FSDP2, expert or pipeline parallel)
asks for the index region of the parameter it holds; a `Source` says how the parameter is made
from the checkpoint's tensors (transposed, concatenated, stacked, permuted along a dim, or drawn
at random) and reads exactly the parts of those tensors the region covers:

    SliceReader(model_dir)                 lazy safetensors; `read(name, region)` reads only region
    Tensor(reader, name, shape)            a checkpoint tensor as is
    Transposed(src)  Concat(dim, parts)  Narrowed(src, dim, start, length)  Stack(parts)
    Permuted(src, dim, perm)  Generated(shape, fill)

A region is one (start, stop) pair per dimension, in the coordinates of the source's full shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

Region = tuple[tuple[int, int], ...]


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


def region_numel(region: Region) -> int:
    n = 1
    for a, b in region:
        n *= max(b - a, 0)
    return n


class SliceReader:
    """The tensors of a Hugging Face model directory (or one .safetensors file), read by region.

    Files are opened lazily (memory-mapped headers only); `read` asks safetensors for the slice
    alone, so a rank's resident memory holds what it keeps. `bytes_read` counts the bytes of
    every slice returned (per tensor name in `bytes_by_name`), which tests hold against the
    share a rank should read."""

    def __init__(self, path: str | os.PathLike):
        from backends.common.checkpoint.hf_io import read_safetensors

        self.path = path
        self._files = read_safetensors(path)
        self.bytes_read = 0
        self.bytes_by_name: dict[str, int] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files.shape(name)

    def release(self) -> None:
        """Unmap the files: a region read through safetensors is a view of the file's pages, and every
        page touched stays in the resident set while the file is mapped (a column slice touches the
        whole tensor). Called after each parameter, the resident file pages stay within one tensor."""
        self._files.close()

    def read(self, name: str, region: Region) -> torch.Tensor:
        piece = self._files.get_slice(name)[tuple(slice(a, b) for a, b in region)]
        n = piece.numel() * piece.element_size()
        self.bytes_read += n
        self.bytes_by_name[name] = self.bytes_by_name.get(name, 0) + n
        return piece


class Source:
    """A tensor of `shape` that can produce any region of itself."""

    shape: tuple[int, ...]

    def read(self, region: Region) -> torch.Tensor:
        raise NotImplementedError

    def full(self) -> torch.Tensor:
        return self.read(full_region(self.shape))


class Tensor(Source):
    """A checkpoint tensor, read from anything with `read(name, region)` (a SliceReader)."""

    def __init__(self, reader, name: str, shape: Sequence[int]):
        self.reader, self.name, self.shape = reader, name, tuple(shape)

    def read(self, region: Region) -> torch.Tensor:
        return self.reader.read(self.name, region)


class Transposed(Source):
    """The 2-D source transposed (an HF linear weight [out, in] stored as [in, out])."""

    def __init__(self, src: Source):
        if len(src.shape) != 2:
            raise ValueError(f"Transposed wants a 2-D source, got shape {src.shape}")
        self.src, self.shape = src, (src.shape[1], src.shape[0])

    def read(self, region: Region) -> torch.Tensor:
        return self.src.read((region[1], region[0])).t()


class Concat(Source):
    """Parts concatenated along `dim` (their other dims equal)."""

    def __init__(self, dim: int, parts: Sequence[Source]):
        self.dim, self.parts = dim, list(parts)
        first = self.parts[0].shape
        self.shape = tuple(sum(p.shape[dim] for p in self.parts) if d == dim else n for d, n in enumerate(first))

    def read(self, region: Region) -> torch.Tensor:
        a, b = region[self.dim]
        pieces, offset = [], 0
        for part in self.parts:
            n = part.shape[self.dim]
            lo, hi = max(a, offset), min(b, offset + n)
            if lo < hi:
                sub = list(region)
                sub[self.dim] = (lo - offset, hi - offset)
                pieces.append(part.read(tuple(sub)))
            offset += n
        if not pieces:  # an empty region (an uneven shard past the end)
            return self.parts[0].read(tuple((0, 0) if d == self.dim else r for d, r in enumerate(region)))
        return torch.cat(pieces, dim=self.dim)


class Narrowed(Source):
    """`length` entries of the source along `dim` from `start` (a row range of a fused tensor)."""

    def __init__(self, src: Source, dim: int, start: int, length: int):
        if start < 0 or start + length > src.shape[dim]:
            raise ValueError(f"rows {start}..{start + length} of dim {dim} are outside shape {src.shape}")
        self.src, self.dim, self.start = src, dim, start
        self.shape = tuple(length if d == dim else n for d, n in enumerate(src.shape))

    def read(self, region: Region) -> torch.Tensor:
        a, b = region[self.dim]
        return self.src.read(tuple((a + self.start, b + self.start) if d == self.dim else r
                                   for d, r in enumerate(region)))


class Stack(Source):
    """Parts stacked on a new leading dim (per-expert weights as one [E, ...] tensor)."""

    def __init__(self, parts: Sequence[Source]):
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)

    def read(self, region: Region) -> torch.Tensor:
        a, b = region[0]
        rows = [self.parts[e].read(region[1:]) for e in range(a, b)]
        if not rows:
            return torch.empty((0, *(hi - lo for lo, hi in region[1:])))
        return torch.stack(rows)


class Permuted(Source):
    """out[.., j, ..] = src[.., perm[j], ..] along `dim`: reads the runs of source indices a region needs."""

    def __init__(self, src: Source, dim: int, perm: torch.Tensor):
        dim %= len(src.shape)
        if perm.numel() != src.shape[dim]:
            raise ValueError(f"permutation of {perm.numel()} for dim {dim} of shape {src.shape}")
        self.src, self.dim, self.perm, self.shape = src, dim, perm.long(), src.shape

    def read(self, region: Region) -> torch.Tensor:
        a, b = region[self.dim]
        wanted = self.perm[a:b]
        needed = torch.unique(wanted)  # sorted
        # contiguous runs of needed source indices, each read once
        breaks = (torch.nonzero(needed[1:] - needed[:-1] != 1).flatten() + 1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, needed.numel()]
        pieces = []
        for s, e in zip(starts, ends):
            sub = list(region)
            sub[self.dim] = (int(needed[s]), int(needed[e - 1]) + 1)
            pieces.append(self.src.read(tuple(sub)))
        if not pieces:
            return self.src.read(tuple((0, 0) if d == self.dim else r for d, r in enumerate(region)))
        got = torch.cat(pieces, dim=self.dim)
        position = torch.searchsorted(needed, wanted)  # where each wanted index sits in `got`
        return got.index_select(self.dim, position)


class Generated(Source):
    """A tensor drawn whole by `fill(tensor)` (e.g. a seeded random init), then cut to the region:
    the values do not depend on which region a rank asks for."""

    def __init__(self, shape: Sequence[int], fill: Callable[[torch.Tensor], None], dtype=torch.float32):
        self.shape, self.fill, self.dtype = tuple(shape), fill, dtype

    def read(self, region: Region) -> torch.Tensor:
        whole = torch.empty(self.shape, dtype=self.dtype)
        with torch.no_grad():
            self.fill(whole)
        return whole[tuple(slice(a, b) for a, b in region)]


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, name): the same draws for a parameter whatever the layout."""
    import hashlib

    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return g
