"""A Megatron checkpoint (megatron_checkpoint.open_checkpoint) seen under Hugging Face tensor names, each a
slices.Source over the stored shards: per-rank loading reads it like a safetensors directory
(`names`, `in`, `shape`, `read(name, region)`, `release`, `bytes_read`), whatever layout it was saved with.

mcore's layer keys (decoder.layers.N. + ...; N local to the pipeline stage in the torch format, global or
a stacked leading axis in torch_dist) and what they hold, per tensor-parallel shard:

    input_layernorm.weight | self_attention.linear_qkv.layer_norm_weight    input_layernorm
    self_attention.linear_qkv.weight / .bias   per query group [q heads of the group, k, v] rows
    self_attention.linear_proj.weight          o_proj, split on its input dim
    self_attention.q_layernorm / k_layernorm   q_norm / k_norm
    pre_mlp_layernorm.weight | mlp.linear_fc1.layer_norm_weight              post_attention_layernorm
    mlp.linear_fc1.weight                      [gate shard; up shard] rows; mlp.linear_fc2.weight: down_proj
    mlp.router.weight                          the MoE gate
    experts: mlp.experts.local_experts.E.linear_fc1/2.weight (SequentialMLP), mlp.experts.linear_fc1/2.weightE
    (TEGroupedMLP), mlp.experts.weight1 [H, E*2I] / weight2 [E*I, H] (GroupedMLP, per expert [gate|up]^T and
    down^T), mlp.experts.experts.linear_fc1/2.weight [E, ...] (torch_dist, any of them)
    mlp.shared_experts.linear_fc1 / linear_fc2  the shared experts, as a dense MLP; mlp.router.expert_bias: the
                                               DeepSeek-V3 routing bias (e_score_correction_bias)
    embedding.word_embeddings.weight, decoder.final_layernorm.weight, output_layer.weight

Multi-latent attention (DeepSeek), MindSpeed-LLM's layout (convert_hf2mg.py, CustomMLASelfAttention):

    self_attention.linear_qkv.weight           [q_a_proj (q_proj without --q-lora-rank); kv_a_proj_with_mqa] rows,
                                               the whole tensor on every tp rank (LinearNoTP)
    self_attention.q_layernorm / kv_layernorm  q_a_layernorm / kv_a_layernorm
    self_attention.linear_q_up_proj / linear_kv_up_proj   q_b_proj / kv_b_proj, split on dim 0 (by heads)
    --mla-mm-split: linear_qk_nope + linear_qk_rope = q_b_proj, linear_kv_nope + linear_v = kv_b_proj, each
                                               per head's rows of one part, split on dim 0 (by heads)

and megatron-core's (MLASelfAttention): linear_q_proj, linear_q_down_proj, linear_kv_down_proj (q_proj, q_a_proj,
kv_a_proj_with_mqa: column parallel, split on dim 0), linear_q_up_proj / linear_kv_up_proj as above, the latent
norms as q_layernorm / kv_layernorm or fused into the up projections (TE: linear_q_up_proj.layer_norm_weight).

Vocabulary rows and the column-parallel outputs are split over the tp ranks on dim 0, row-parallel inputs on
dim 1; torch_dist stores each tensor whole, as one shard. Keys this mapping does not know (MTP layers ...) are
listed under their own names, so the loader names them as having no place in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.common.checkpoint.megatron_checkpoint import (
    DistStore, LegacyStore, MegatronCheckpoint, MegatronCheckpointError, iter_layer_keys,
)
from backends.common.checkpoint.slices import Concat, Narrowed, Region, Source, Transposed

ALTERNATIVES = {"input_layernorm": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                "pre_mlp_layernorm": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")}


@dataclass(frozen=True)
class MlaDims:
    """DeepSeek's multi-latent attention sizes (q_lora_rank None: q_proj, no q down projection)."""
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Naming:
    """What the HF names and the fused attention rows depend on (the engine takes them from its model)."""
    num_heads: int
    num_groups: int
    head_dim: int
    mlp: str = "mlp"                                   # Mixtral: block_sparse_moe
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fused_gate_up: bool = False                        # GLM's mlp.gate_up_proj = [gate; up]
    mla: MlaDims | None = None                         # DeepSeek's multi-latent attention


class Piece(Source):
    """One stored tensor (`index` fixes its leading dims: a stacked layer, an expert)."""

    def __init__(self, store, key, index: tuple[int, ...] = ()):
        self.store, self.key, self.index = store, key, index
        self.shape = tuple(store.shape(key)[len(index):])

    def read(self, region: Region):
        t = self.store.read(self.key, tuple((i, i + 1) for i in self.index) + tuple(region))
        return t.reshape(t.shape[len(self.index):])


class _Layer:
    """One decoder layer's tensors as lists of tensor-parallel shards (a single one for torch_dist)."""

    def __init__(self, shards_of, experts_of, keys: set[str]):
        self.shards_of, self.experts_of, self.keys = shards_of, experts_of, keys

    def get(self, *names: str) -> list[Source] | None:
        for name in names:
            if name in self.keys:
                return self.shards_of(name)
        return None


class MegatronView:
    """HF name -> Source over the checkpoint's shards (see the module docstring)."""

    def __init__(self, ckpt: MegatronCheckpoint, naming: Naming):
        self.path, self.naming, self.store = str(ckpt.load), naming, ckpt.store
        self.bytes_read = 0
        self.sources: dict[str, Source] = {}
        self.origin: dict[str, str] = {}            # HF name -> where it is stored (for messages)
        self._claimed: set = set()
        if isinstance(ckpt.store, DistStore):
            layers, top = self._dist_layers(ckpt.store)
        else:
            layers, top = self._legacy_layers(ckpt.store)
        self._top(top)
        for i, layer in enumerate(layers):
            self._layer(i, layer)
        self.unknown = sorted({self.store.where(key) for key in self.store.shapes
                               if self.store.identity(key) not in self._claimed})

    # ------------------------------------------------------------------ the loader's interface

    def names(self) -> list[str]:
        return [*self.sources, *self.unknown]

    def __contains__(self, name: object) -> bool:
        return name in self.sources

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sources[name].shape)

    def read(self, name: str, region: Region):
        piece = self.sources[name].read(region)
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def release(self) -> None:
        self.store.release()

    def stored_name(self, name: str) -> str:
        return self.origin.get(name, name)

    # ------------------------------------------------------------------ the two formats

    def _legacy_layers(self, store: LegacyStore):
        files = store.files
        layers, top = [], {}
        order = [(v, p) for v in range(len(store.chunks[0])) for p in range(files.pp)]  # Megatron's layer order
        for v, p in order:
            chunk = store.chunks[p][v]
            by_layer: dict[int, set[str]] = {}
            for n, rest in iter_layer_keys(store.keys(0, p, 0, chunk)):
                by_layer.setdefault(n, set()).add(rest)
            for name in store.keys(0, p, 0, chunk):
                if not name.startswith("decoder.layers."):
                    top.setdefault(name, [(t, p, 0, chunk, name) for t in range(files.tp)])
            for local in sorted(by_layer):
                prefix = f"decoder.layers.{local}."

                def shards(rest, p=p, chunk=chunk, prefix=prefix):
                    keys = [(t, p, 0, chunk, prefix + rest) for t in range(files.tp)]
                    self._claim(*keys)
                    return [Piece(store, k) for k in keys]

                def experts(which, e, p=p, chunk=chunk, prefix=prefix):
                    return self._legacy_expert(store, p, chunk, prefix, which, e)

                layers.append(_Layer(shards, experts, by_layer[local]))
        return layers, top

    def _legacy_expert(self, store: LegacyStore, p, chunk, prefix, which, e) -> list[Source]:
        """Expert e's linear_fc1 ([gate; up] shard, [2I/tp, H]) or linear_fc2 ([H, I/tp]) on each tp rank."""
        files = store.files
        per_rank = self._experts_per_rank(store, p, chunk, prefix)
        x, local = divmod(e, per_rank)
        out = []
        for t in range(files.tp):
            names = set(store.keys(t, p, x, chunk))
            base = (t, p, x, chunk)
            seq = f"{prefix}mlp.experts.local_experts.{local}.{which}.weight"   # SequentialMLP
            te = f"{prefix}mlp.experts.{which}.weight{local}"                   # TEGroupedMLP
            if seq in names or te in names:
                key = base + ((seq if seq in names else te),)
                self._claim(key)
                out.append(Piece(store, key))
                continue
            grouped = f"{prefix}mlp.experts.{'weight1' if which == 'linear_fc1' else 'weight2'}"
            if grouped not in names:
                raise MegatronCheckpointError(f"no weights of expert {e} ({which}) in "
                                              f"{files.paths[(t, p, x)].parent.name}")
            stored = store.shape(base + (grouped,))
            self._claim(base + (grouped,))
            if which == "linear_fc1":   # [H, E_local * 2I/tp] = per expert [gate | up]^T
                view = (per_rank, stored[0], stored[1] // per_rank)
            else:                       # [E_local * I/tp, H] = per expert down^T
                view = (per_rank, stored[0] // per_rank, stored[1])
            out.append(Transposed(Piece(store, base + (grouped, view), index=(local,))))
        return out

    def _experts_per_rank(self, store: LegacyStore, p, chunk, prefix) -> int:
        names = store.keys(0, p, 0, chunk)
        seq = {n for n in names
               if n.startswith(f"{prefix}mlp.experts.local_experts.") and n.endswith("linear_fc1.weight")}
        te = {n for n in names if n.startswith(f"{prefix}mlp.experts.linear_fc1.weight")}
        if seq or te:
            return len(seq or te)
        router = store.shape((0, p, 0, chunk, f"{prefix}mlp.router.weight"))
        return router[0] // store.files.ep

    def _dist_layers(self, store: DistStore):
        stacked: dict[str, int] = {}
        per_layer: dict[int, set[str]] = {}
        top = {}
        for key in store.keys():
            if not key.startswith("decoder.layers."):
                top[key] = [key]
                continue
            rest = key[len("decoder.layers."):]
            head, _, tail = rest.partition(".")
            if head.isdigit():
                per_layer.setdefault(int(head), set()).add(tail)
            else:
                stacked[rest] = store.shape(key)[0]
        counts = set(stacked.values())
        if len(counts) > 1:
            raise MegatronCheckpointError(f"the stacked layer tensors disagree on the layer count "
                                          f"({sorted(counts)})")
        total = max([*counts, *(n + 1 for n in per_layer)], default=0)
        layers = []
        for i in range(total):
            keys = {rest for rest in stacked if i in store.covered[f"decoder.layers.{rest}"]} | per_layer.get(i, set())

            def shards(rest, i=i):
                key = f"decoder.layers.{i}.{rest}"
                if key in store.shapes:
                    self._claim(key)
                    return [Piece(store, key)]
                key = f"decoder.layers.{rest}"
                self._claim(key)
                return [Piece(store, key, index=(i,))]

            def experts(which, e, i=i):
                rest = f"mlp.experts.experts.{which}.weight"
                key = f"decoder.layers.{i}.{rest}"
                if key in store.shapes:
                    self._claim(key)
                    return [Piece(store, key, index=(e,))]
                key = f"decoder.layers.{rest}"
                self._claim(key)
                return [Piece(store, key, index=(i, e))]

            layers.append(_Layer(shards, experts, keys))
        return layers, top

    # ------------------------------------------------------------------ HF names

    def _top_shards(self, keys: list) -> list[Source]:
        self._claim(*keys)
        return [Piece(self.store, k) for k in keys]

    def _top(self, top: dict) -> None:
        for ours, theirs in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                             ("lm_head.weight", "output_layer.weight")):
            if theirs in top:
                self._add(ours, Concat(0, self._top_shards(top[theirs])), theirs)
        if "decoder.final_layernorm.weight" in top:
            self._add("model.norm.weight", self._top_shards(top["decoder.final_layernorm.weight"])[0],
                      "decoder.final_layernorm.weight")

    def _claim(self, *keys) -> None:
        self._claimed.update(self.store.identity(k) for k in keys)

    def _add(self, name: str, src: Source, where: str) -> None:
        self.sources[name] = src
        self.origin[name] = where

    def _layer(self, i: int, layer: _Layer) -> None:
        n = self.naming
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for ours, theirs in (("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "pre_mlp_layernorm")):
            shards = layer.get(*ALTERNATIVES[theirs])
            if shards:
                self._add(f"{hf}{ours}.weight", shards[0], mg + theirs)
        if n.mla is not None:
            self._mla(hf, mg, layer)
        for kind in ("weight", "bias") if n.mla is None else ():
            qkv = layer.get(f"self_attention.linear_qkv.{kind}")
            if qkv:
                for proj, src in zip(("q_proj", "k_proj", "v_proj"), self._split_qkv(qkv, i)):
                    self._add(f"{hf}self_attn.{proj}.{kind}", src, f"{mg}self_attention.linear_qkv.{kind}")
        dense = layer.get("self_attention.linear_proj.weight")
        if dense:
            self._add(f"{hf}self_attn.o_proj.weight", Concat(1, dense), f"{mg}self_attention.linear_proj.weight")
        for ours, theirs in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")) if n.mla is None else ():
            shards = layer.get(f"self_attention.{theirs}.weight")
            if shards:
                self._add(f"{hf}self_attn.{ours}.weight", shards[0], f"{mg}self_attention.{theirs}.weight")
        mlp = f"{hf}{n.mlp}."
        router = layer.get("mlp.router.weight")
        if router:
            self._add(f"{mlp}gate.weight", router[0], f"{mg}mlp.router.weight")
            bias = layer.get("mlp.router.expert_bias")
            if bias:
                self._add(f"{mlp}gate.e_score_correction_bias", bias[0], f"{mg}mlp.router.expert_bias")
            self._dense_mlp(layer, f"{mlp}shared_experts.", f"{mg}mlp.shared_experts.")
            experts = router[0].shape[0]
            gate, up, down = n.experts
            for e in range(experts):
                fc1 = layer.experts_of("linear_fc1", e)
                g, u = self._halves(fc1, f"{mg}mlp.experts (expert {e})")
                self._add(f"{mlp}experts.{e}.{gate}.weight", g, f"{mg}mlp.experts (expert {e} linear_fc1)")
                self._add(f"{mlp}experts.{e}.{up}.weight", u, f"{mg}mlp.experts (expert {e} linear_fc1)")
                self._add(f"{mlp}experts.{e}.{down}.weight", Concat(1, layer.experts_of("linear_fc2", e)),
                          f"{mg}mlp.experts (expert {e} linear_fc2)")
            return
        self._dense_mlp(layer, mlp, f"{mg}mlp.")

    def _dense_mlp(self, layer: _Layer, hf: str, mg: str) -> None:
        """linear_fc1 ([gate; up] per tp shard) and linear_fc2 (split on dim 1) of the MLP under `mg`."""
        rest = mg.split(".", 3)[3]   # what follows decoder.layers.N.
        fc1, fc2 = layer.get(f"{rest}linear_fc1.weight"), layer.get(f"{rest}linear_fc2.weight")
        if fc1:
            g, u = self._halves(fc1, f"{mg}linear_fc1.weight")
            if self.naming.fused_gate_up:
                self._add(f"{hf}gate_up_proj.weight", Concat(0, [g, u]), f"{mg}linear_fc1.weight")
            else:
                self._add(f"{hf}gate_proj.weight", g, f"{mg}linear_fc1.weight")
                self._add(f"{hf}up_proj.weight", u, f"{mg}linear_fc1.weight")
        if fc2:
            self._add(f"{hf}down_proj.weight", Concat(1, fc2), f"{mg}linear_fc2.weight")

    def _mla(self, hf: str, mg: str, layer: _Layer) -> None:
        """The multi-latent attention tensors of one layer (module docstring) under HF DeepSeek's names."""
        m, heads = self.naming.mla, self.naming.num_heads
        attn, at = f"{hf}self_attn.", f"{mg}self_attention."
        q_first = "q_proj" if m.q_lora_rank is None else "q_a_proj"
        fused = layer.get("self_attention.linear_qkv.weight")
        if fused:   # one whole copy per tp rank: the first
            rows = m.q_lora_rank or heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
            total = fused[0].shape[0]
            if total <= rows:
                raise MegatronCheckpointError(f"{at}linear_qkv.weight has {total} rows, not the {rows} of {q_first} "
                                              f"and kv_a_proj_with_mqa's after them; the attention flags "
                                              f"(--q-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim) must describe "
                                              f"the checkpoint")
            self._add(f"{attn}{q_first}.weight", Narrowed(fused[0], 0, 0, rows), f"{at}linear_qkv.weight")
            self._add(f"{attn}kv_a_proj_with_mqa.weight", Narrowed(fused[0], 0, rows, total - rows),
                      f"{at}linear_qkv.weight")
        for ours, theirs in (("q_proj", "linear_q_proj"), ("q_a_proj", "linear_q_down_proj"),
                             ("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("q_b_proj", "linear_q_up_proj"),
                             ("kv_b_proj", "linear_kv_up_proj")):
            shards = layer.get(f"self_attention.{theirs}.weight")
            if shards:
                self._add(f"{attn}{ours}.weight", Concat(0, shards), f"{at}{theirs}.weight")
        for ours, names in (("q_a_layernorm", ("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight")),
                            ("kv_a_layernorm", ("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"))):
            name = next((name for name in names if f"self_attention.{name}" in layer.keys), None)
            if name:
                self._add(f"{attn}{ours}.weight", layer.get(f"self_attention.{name}")[0], at + name)
        for ours, parts in (("q_b_proj", (("linear_qk_nope", m.qk_nope_head_dim), ("linear_qk_rope", m.qk_rope_head_dim))),
                            ("kv_b_proj", (("linear_kv_nope", m.qk_nope_head_dim), ("linear_v", m.v_head_dim)))):
            got = [layer.get(f"self_attention.{name}.weight") for name, _ in parts]
            if all(got):   # --mla-mm-split: per head [first part's rows; second part's rows]
                whole = [(Concat(0, shards), width) for shards, (_, width) in zip(got, parts)]
                self._add(f"{attn}{ours}.weight",
                          Concat(0, [Narrowed(src, 0, h * width, width) for h in range(heads) for src, width in whole]),
                          " + ".join(f"{at}{name}.weight" for name, _ in parts))

    def _halves(self, shards: list[Source], where: str) -> tuple[Source, Source]:
        """[gate; up] of each shard -> (gate, up) over all shards."""
        rows = shards[0].shape[0]
        if rows % 2:
            raise MegatronCheckpointError(f"{where} has {rows} rows per shard, not [gate; up] halves")
        half = rows // 2
        return (Concat(0, [Narrowed(s, 0, 0, half) for s in shards]),
                Concat(0, [Narrowed(s, 0, half, half) for s in shards]))

    def _split_qkv(self, shards: list[Source], i: int) -> tuple[Source, Source, Source]:
        """linear_qkv rows, per query group [its q heads, k, v] (each shard holds whole groups) -> q, k, v."""
        n = self.naming
        per_q = n.num_heads // n.num_groups * n.head_dim
        group = per_q + 2 * n.head_dim
        rows = shards[0].shape[0]
        if rows % group:
            raise MegatronCheckpointError(
                f"layer {i}'s linear_qkv has {rows} rows per tensor-parallel shard, not a whole number "
                f"of query groups of {group} rows ({n.num_heads // n.num_groups} query heads + k + v of "
                f"{n.head_dim}); the attention flags (--num-attention-heads, --num-query-groups, --kv-channels) "
                f"must describe the checkpoint")
        parts: tuple[list, list, list] = ([], [], [])
        for s in shards:
            for g in range(rows // group):
                start = g * group
                parts[0].append(Narrowed(s, 0, start, per_q))
                parts[1].append(Narrowed(s, 0, start + per_q, n.head_dim))
                parts[2].append(Narrowed(s, 0, start + per_q + n.head_dim, n.head_dim))
        return tuple(Concat(0, p) for p in parts)
