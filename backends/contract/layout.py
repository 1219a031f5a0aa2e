"""The parallel layout rules, in one place.

The planner checks a job with them and every engine checks its own flags with them before it
builds its DeviceMesh from the `Layout` they return, so a layout that plans also starts. Plain
numbers in (no JobSpec, no torch: engines import this module), every broken rule out at once,
each naming the job-file field it belongs to.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Sequence

from backends.contract.megatron import CP_ALGO_NAMES

# our names of the context-parallel algorithms (parallel.cp_algo): ring, ulysses, hybrid
CP_ALGOS = tuple(CP_ALGO_NAMES.values())

# Upper bounds of the numbers a layout is made of. Rules below build lists as long as pp and
# loop over layers, so every number is held against these first: a typo such as pp: 2**63 is one
# clear error, not minutes of work. They sit far above any real cluster or model; the job schema
# (ascendfactory.spec) applies the same bounds when it reads the file.
MAX_PARALLEL = 65536           # tp, pp, vpp, cp, ep, ulysses_degree
MAX_NODES = 65536
MAX_DEVICES_PER_NODE = 1024
MAX_WORLD = 1 << 20            # ranks in one job
MAX_LAYERS = 1 << 16
MAX_HEADS = 1 << 16            # attention and KV heads
MAX_EXPERTS = 1 << 16
MAX_SEQ_LEN = 1 << 24
MAX_BATCH = 1 << 24            # samples: micro and global batch


@dataclass(frozen=True)
class LayoutProblem:
    field: str               # dotted job-file field, e.g. "parallel.tp"
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" + (f" ({self.hint})" if self.hint else "")


class LayoutError(ValueError):
    """Every broken layout rule of one layout."""

    def __init__(self, problems: Sequence[LayoutProblem]):
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(f"the parallel layout does not work ({n} problem{'s' if n != 1 else ''}): "
                         + "; ".join(map(str, self.problems)))


@dataclass(frozen=True)
class Layout:
    world: int
    nnodes: int
    devices_per_node: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    sp: bool
    ulysses_degree: int
    ring_degree: int
    micro_batch: int
    global_batch: int
    grad_accum: int          # micro-batches per optimizer step on one rank (0: batch not given)
    pp_layers: tuple[int, ...]

    def describe(self) -> str:
        parts = [f"world {self.world} = {self.nnodes} node(s) × {self.devices_per_node} device(s)",
                 f"tp {self.tp}", f"pp {self.pp}" + (f" (vpp {self.vpp})" if self.vpp > 1 else ""),
                 f"cp {self.cp}", f"dp {self.dp}", f"ep {self.ep}"]
        return " · ".join(parts)

    def sizes(self) -> dict[str, int]:
        """The parallel sizes by name (what an engine records as the layout it built)."""
        return {key: getattr(self, key) for key in ("dp", "tp", "pp", "vpp", "cp", "ep")}

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp): tp innermost, so a tensor-parallel group shares a node."""
        return (self.pp, self.dp, self.cp, self.tp)


def solve(*, world: int, heads: int, kv_heads: int, layers: int, experts: int = 0, nnodes: int = 1,
          tp: int = 1, pp: int = 1, vpp: int = 1, vpp_layers: int | None = None,
          pp_layers: Sequence[int] | None = None, cp: int = 1, cp_algo: str = "ring",
          ulysses_degree: int | None = None, ep: int = 1, sp: bool = False, seq_len: int | None = None,
          micro_batch: int | None = None, global_batch: int | None = None,
          ) -> tuple[Layout | None, list[LayoutProblem]]:
    """The layout of `world` ranks, or None and every rule it breaks.

    `vpp` is the number of model chunks per pipeline rank; `vpp_layers` (Megatron's
    --num-layers-per-virtual-pipeline-stage) says the same in layers, for callers that have that.
    Rules whose inputs are not given (seq_len, the batch sizes) are not checked.
    """
    problems: list[LayoutProblem] = []

    def bad(field: str, message: str, hint: str | None = None) -> None:
        problems.append(LayoutProblem(field, message, hint))

    _bounds(bad, world=world, nnodes=nnodes, heads=heads, kv_heads=kv_heads, layers=layers, experts=experts, tp=tp,
            pp=pp, vpp=vpp, vpp_layers=vpp_layers, pp_layers=pp_layers, cp=cp, ulysses_degree=ulysses_degree, ep=ep,
            seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch)
    if problems:  # nothing below is safe to build from an out-of-range number
        return None, problems
    devices_per_node = world // nnodes if nnodes and world % nnodes == 0 else world
    model_par = tp * pp * cp
    dp = world // model_par if world % model_par == 0 else 0
    if not dp:
        bad("parallel", f"data parallel size = world / (tp·pp·cp) = {world} / {model_par} is not a whole number "
                        f"(world {world} = {nnodes} node(s) × {devices_per_node} device(s))",
            f"pick tp·pp·cp dividing {world}, or change resources.nnodes / devices_per_node")

    _heads_over_tp(bad, heads, kv_heads, tp, sp)
    vpp = _vpp_from_layers(bad, layers, pp, vpp, vpp_layers, pp_layers)
    stages = _pipeline(bad, layers, pp, vpp, pp_layers)
    _experts(bad, experts, ep, dp * cp * tp, (dp, cp, tp))
    ulysses, ring = _context_parallel(bad, heads, tp, cp, cp_algo, ulysses_degree, seq_len)
    grad_accum = _batches(bad, dp, pp, vpp, micro_batch, global_batch)

    if problems:
        return None, problems
    return Layout(world=world, nnodes=nnodes, devices_per_node=devices_per_node, tp=tp, pp=pp, vpp=vpp, cp=cp,
                  dp=dp, ep=ep, sp=sp, ulysses_degree=ulysses, ring_degree=ring, micro_batch=micro_batch or 0,
                  global_batch=global_batch or 0, grad_accum=grad_accum, pp_layers=tuple(stages)), []


def check(**numbers) -> Layout:
    """`solve`, raising one LayoutError with every broken rule."""
    layout, problems = solve(**numbers)
    if problems:
        raise LayoutError(problems)
    return layout


# field → (job-file field, lowest, highest, what to do); None values are not given, not checked
_BOUNDS = {
    "world": ("resources", 1, MAX_WORLD, "lower resources.nnodes or resources.devices_per_node"),
    "nnodes": ("resources.nnodes", 1, MAX_NODES, "set resources.nnodes to the number of machines"),
    "heads": ("model_overrides.num_attention_heads", 1, MAX_HEADS, "check the model's config or model_overrides"),
    "kv_heads": ("model_overrides.num_kv_heads", 1, MAX_HEADS, "check the model's config or model_overrides"),
    "layers": ("model_overrides.num_layers", 1, MAX_LAYERS, "check the model's config or model_overrides"),
    "experts": ("model_overrides.num_experts", 0, MAX_EXPERTS, "check the model's config or model_overrides"),
    "tp": ("parallel.tp", 1, MAX_PARALLEL, "a parallel size is at most the number of devices: lower it"),
    "pp": ("parallel.pp", 1, MAX_PARALLEL, "use at most one pipeline stage per layer"),
    "vpp": ("parallel.vpp", 1, MAX_PARALLEL, "use a vpp that divides every pipeline stage's layers"),
    "vpp_layers": ("parallel.vpp", 1, MAX_LAYERS, "use a layer count per virtual stage that divides the layers"),
    "cp": ("parallel.cp", 1, MAX_PARALLEL, "a parallel size is at most the number of devices: lower it"),
    "ulysses_degree": ("parallel.ulysses_degree", 1, MAX_PARALLEL, "use a divisor of parallel.cp"),
    "ep": ("parallel.ep", 1, MAX_PARALLEL, "use an ep that divides the expert count"),
    "seq_len": ("data.seq_len", 1, MAX_SEQ_LEN, "lower data.seq_len"),
    "micro_batch": ("train.micro_batch", 1, MAX_BATCH, "lower train.micro_batch"),
    "global_batch": ("train.global_batch", 1, MAX_BATCH, "lower train.global_batch"),
}


_OPTIONAL = ("vpp_layers", "ulysses_degree", "seq_len", "micro_batch", "global_batch")


def _whole_in(value, lo: int, hi: int) -> bool:
    try:
        return lo <= operator.index(value) <= hi
    except TypeError:
        return False


def _bounds(bad, pp_layers, **numbers) -> None:
    for name, value in numbers.items():
        field, lo, hi, what = _BOUNDS[name]
        if name in _OPTIONAL and (value is None or (name == "vpp_layers" and value == 0)):  # not given
            continue
        if not _whole_in(value, lo, hi):
            bad(field, f"{show_number(value)} is out of range: allowed whole numbers {lo} … {hi}", what)
    if pp_layers is not None:
        if len(pp_layers) > MAX_PARALLEL or not all(_whole_in(n, 1, MAX_LAYERS) for n in pp_layers):
            bad("parallel.pp_layers", f"needs at most {MAX_PARALLEL} whole numbers of layers, each 1 … {MAX_LAYERS}",
                "give one layer count per pipeline stage")


def show_number(value) -> str:
    """A number for an error message: a huge one by its size, not by thousands of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        # str() refuses ints of more than 4300 digits: beyond that, the size from the logarithm
        digits = len(str(abs(value))) if value.bit_length() < 13000 else math.floor(math.log10(abs(value))) + 1
        return f"a{' negative' if value < 0 else ''} number of about {digits} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _heads_over_tp(bad, heads: int, kv: int, tp: int, sp: bool) -> None:
    if heads % tp:
        bad("parallel.tp", f"{heads} attention heads do not split over tp={tp}",
            f"use a tp that divides {heads}: {', '.join(map(str, divisors(heads, upto=64)))}")
    if kv >= tp and kv % tp:
        bad("parallel.tp", f"{kv} KV heads do not split evenly over tp={tp}", f"use a tp that divides {kv}")
    if kv < tp and tp % kv:
        bad("parallel.tp", f"tp={tp} above the {kv} KV heads must be a multiple of them (KV heads are replicated)",
            f"use tp = {kv}·k")
    if sp and tp == 1:
        bad("parallel.sp", "sequence parallel shards activations over the tensor-parallel group, which is 1",
            "set parallel.tp > 1, or sp: false")


def _vpp_from_layers(bad, layers: int, pp: int, vpp: int, vpp_layers: int | None, pp_layers) -> int:
    """Model chunks per pipeline rank, from vpp or from layers per virtual stage."""
    if not vpp_layers:
        return vpp
    if layers % (pp * vpp_layers):
        bad("parallel.vpp", f"{layers} layers do not split evenly over pp={pp} × {vpp_layers} layers per virtual "
                            "stage", "change the layers per virtual stage, or the pipeline size")
        return 1
    return layers // (pp * vpp_layers)


def _pipeline(bad, layers: int, pp: int, vpp: int, pp_layers) -> list[int]:
    if pp_layers is not None:
        pp_layers = list(pp_layers)
        if len(pp_layers) != pp or sum(pp_layers) != layers or min(pp_layers, default=0) < 1:
            bad("parallel.pp_layers", f"needs {pp} positive entries summing to {layers} layers, got {pp_layers}",
                f"e.g. {even_split(layers, pp)}")
        stages = pp_layers
    else:
        if layers % pp:
            bad("parallel.pp", f"{layers} layers do not split evenly over pp={pp}",
                f"use a pp that divides {layers}, or give parallel.pp_layers, e.g. {even_split(layers, pp)}")
        stages = even_split(layers, pp)
    if vpp > 1:
        if pp == 1:
            bad("parallel.vpp", "virtual pipeline stages need pipeline parallel", "set parallel.pp > 1, or vpp: 1")
        elif pp_layers is not None:  # Megatron's interleaved schedule cuts equal chunks only
            bad("parallel.vpp", "an explicit per-stage layer list and virtual pipeline stages do not combine",
                "remove parallel.pp_layers, or set vpp: 1")
        elif any(n % vpp for n in stages):
            bad("parallel.vpp", f"each pipeline stage's layers {stages} must split into vpp={vpp} chunks",
                "choose vpp dividing every stage's layer count")
    if pp > 1 and layers < pp:
        bad("parallel.pp", f"pp={pp} exceeds the {layers} layers", f"use pp ≤ {layers}")
    return stages


def _experts(bad, experts: int, ep: int, dp_cp_tp: int, sizes: tuple[int, int, int]) -> None:
    if ep == 1:
        return
    if not experts:
        bad("parallel.ep", f"ep={ep} needs a model with experts; this one has no experts", "set parallel.ep: 1")
        return
    if experts % ep:
        bad("parallel.ep", f"{experts} experts do not split over ep={ep}", f"use an ep that divides {experts}")
    dp, cp, tp = sizes
    if dp and dp_cp_tp % ep:
        bad("parallel.ep", f"ep={ep} must divide dp·cp·tp = {dp}·{cp}·{tp} = {dp_cp_tp} "
                           "(the expert group is carved from those ranks)",
            "change ep or the data/context/tensor parallel sizes")


def _context_parallel(bad, heads: int, tp: int, cp: int, algo: str, u: int | None,
                      seq_len: int | None) -> tuple[int, int]:
    """(Ulysses degree, ring degree)."""
    if u is not None and algo != "hybrid":
        bad("parallel.ulysses_degree", f"only used with cp_algo: hybrid (cp_algo is {algo})",
            "remove it, or set cp_algo: hybrid")
    if algo not in CP_ALGOS:
        bad("parallel.cp_algo", f"unknown context-parallel algorithm {algo!r}", f"use one of {', '.join(CP_ALGOS)}")
        return 1, 1
    if cp == 1:
        return 1, 1
    s = seq_len
    if algo == "ring":
        if s is not None and s % (2 * cp):
            bad("data.seq_len", f"ring attention needs seq_len divisible by 2·cp = {2 * cp}, got {s}",
                f"use seq_len {round_up(s, 2 * cp)}")
        return 1, cp
    if algo == "ulysses":
        if s is not None and s % cp:
            bad("data.seq_len", f"Ulysses needs seq_len divisible by cp = {cp}, got {s}",
                f"use seq_len {round_up(s, cp)}")
        if heads % (cp * tp):
            bad("parallel.cp", f"Ulysses needs heads ({heads}) divisible by cp·tp = {cp * tp}",
                "lower cp or tp, or use cp_algo: ring")
        return cp, 1
    ring = 1
    if u is None:
        bad("parallel.ulysses_degree", "hybrid context parallel needs the Ulysses degree",
            "set parallel.ulysses_degree (Ulysses inside groups of that size, ring across)")
        u = 1
    else:
        if cp % u or cp // u <= 1:
            bad("parallel.ulysses_degree", f"hybrid needs cp / ulysses_degree to be a whole number above 1 "
                                           f"(cp {cp}, ulysses_degree {u})",
                "pick ulysses_degree dividing cp with at least two ring groups, or use ulysses/ring")
        else:
            ring = cp // u
        if heads % (u * tp):
            bad("parallel.ulysses_degree", f"heads ({heads}) must divide by ulysses_degree·tp = {u * tp}",
                "lower ulysses_degree or tp")
    if s is not None and s % (2 * cp):
        bad("data.seq_len", f"hybrid context parallel needs seq_len divisible by 2·cp = {2 * cp}, got {s}",
            f"use seq_len {round_up(s, 2 * cp)}")
    return u, ring


def _batches(bad, dp: int, pp: int, vpp: int, micro: int | None, global_batch: int | None) -> int:
    """Micro-batches per optimizer step on one rank."""
    if not dp or micro is None or global_batch is None:
        return 0
    per_step = micro * dp
    if global_batch % per_step:
        bad("train.global_batch", f"global batch {global_batch} is not a multiple of micro_batch × dp = "
                                  f"{micro} × {dp} = {per_step}",
            f"use a global batch of {round_up(global_batch, per_step)}, or change train.micro_batch")
        return 0
    accum = global_batch // per_step
    if pp > 1 and accum < pp:  # a 1F1B schedule keeps every stage busy: one micro-batch per stage at least
        bad("train.global_batch", f"pipeline parallel needs at least pp={pp} micro-batches per step, but "
                                  f"global_batch / (micro_batch × dp) = {global_batch} / {per_step} = {accum}",
            f"use a global batch of at least {pp * per_step}, or lower train.micro_batch")
    elif pp > 1 and vpp > 1 and accum % pp:
        bad("train.global_batch", f"interleaved pipelining needs the micro-batch count ({accum}) to be a "
                                  f"multiple of pp={pp}", "raise global_batch or lower micro_batch")
    return accum


def divisors(n: int, upto: int | None = None) -> list[int]:
    """Divisors of n in increasing order (those ≤ upto); O(√n) work, bounded by upto when given."""
    small, large = [], []
    i = 1
    while i * i <= n and (upto is None or i <= upto):
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    out = small + large[::-1]
    return [d for d in out if upto is None or d <= upto]


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def even_split(layers: int, pp: int) -> list[int]:
    """Layers per stage, the remainder on the last stages (they hold no embedding)."""
    if not 1 <= pp <= MAX_PARALLEL:
        raise ValueError(f"pipeline size {show_number(pp)} is out of range 1 … {MAX_PARALLEL}")
    base, extra = divmod(layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


# ---------------------------------------------------------------------- RL batches

# the job-file field of each number rl_batches checks (an engine passes its own dialect's keys)
RL_BATCH_FIELDS = {"prompts": "train.global_batch", "mini_batch": "rl.mini_batch", "micro_batch": "train.micro_batch",
                   "n": "rl.rollout.n", "ppo_epochs": "rl.ppo_epochs", "ref_micro": "train.micro_batch",
                   "rollout_tp": "rl.rollout.parallel.tp"}
GROUP_ALGORITHMS = ("grpo", "dapo")  # advantages normalised within each prompt's group of responses


def rl_batches(*, algorithm: str, prompts: int, mini_batch: int, micro_batch: int, n: int, dp: int,
               ppo_epochs: int = 1, fields: dict[str, str] | None = None, who: str = "the framework",
               micro_share: str | None = None, world: int | None = None,
               rollout_dp: int | None = None, ref_dp: int | None = None,
               ref_micro: int | None = None) -> list[LayoutProblem]:
    """The batch arithmetic of one RL step that backends.rl refuses at start, every broken rule at once.

    A step rolls out `prompts` prompts x `n` responses, split over `dp` ranks by prompt; the update
    runs `ppo_epochs` passes over mini-batches of `mini_batch` prompts (each split over the ranks by
    prompt too), in micro-batches of `micro_batch` responses per rank. The planner and the engine
    both call this, so a job that plans also starts.

    A framework's own start-up rules as well, where its adapter asks for them (rl_batch_rules; the
    rendered files must start on the real framework too), `who` naming it in the messages:
      micro_share="mini_batch"  each rank's share of a mini-batch, mini_batch x n / dp responses, is a
                    whole number of micro-batches (VeRL 0.9.1's prepare_micro_batches asserts it;
                    log-prob passes split the rank's whole batch the same way, which follows)
      micro_share="rollout"     each rank's rollout share, prompts / dp x n responses, is a whole
                    number of micro-batches (MindSpeed-RL's validate_rl_args)
      world         prompts x n is a multiple of every device (VeRL's real_train_batch_size % n_gpus)
      rollout_dp    the prompts split over the generation's data-parallel size (MindSpeed-RL's
                    _validate_data_parallel for Generation)
      ref_dp, ref_micro  a reference with a worker of its own (MindSpeed-RL's use_integrated_worker
                    false): the prompts split over the reference's data-parallel size, and each
                    reference rank's share, prompts / ref_dp x n responses, is a whole number of its
                    ref_micro-response micro-batches (_validate_data_parallel for Reference)."""
    names = {**RL_BATCH_FIELDS, **(fields or {})}
    problems: list[LayoutProblem] = []

    def bad(key: str, message: str, hint: str) -> None:
        problems.append(LayoutProblem(names[key], message, hint))

    if algorithm in GROUP_ALGORITHMS and n < 2:
        bad("n", f"{algorithm} compares the responses of one prompt: n must be at least 2, got {n}",
            f"set {names['n']}: 2 or more (8 is usual)")
    if micro_batch < 1:
        bad("micro_batch", f"micro_batch must be at least 1, got {micro_batch}", f"set {names['micro_batch']}: 1 or more")
    if ppo_epochs < 1:
        bad("ppo_epochs", f"ppo_epochs must be at least 1, got {ppo_epochs}", f"set {names['ppo_epochs']}: 1 or more")
    if prompts < 1 or mini_batch < 1 or dp < 1:
        if prompts < 1:
            bad("prompts", f"the batch must hold at least 1 prompt, got {prompts}", f"set {names['prompts']}: 1 or more")
        if mini_batch < 1:
            bad("mini_batch", f"the mini-batch must hold at least 1 prompt, got {mini_batch}",
                f"set {names['mini_batch']}: 1 or more")
        return problems  # the divisibility below needs positive sizes (dp < 1 is the layout's own problem)
    fits = [d for d in divisors(prompts, upto=MAX_BATCH) if d % dp == 0]
    choice = (f"one of {', '.join(map(str, fits[:8]))}{' …' if len(fits) > 8 else ''}" if fits else
              f"a multiple of dp={dp} that divides the batch")
    if prompts % mini_batch:
        bad("mini_batch", f"{names['prompts']} {prompts} (prompts) is not a multiple of the mini-batch size "
                          f"{mini_batch} (prompts): each step updates on whole mini-batches",
            f"set {names['mini_batch']} to {choice}")
    if prompts % dp:
        bad("prompts", f"{names['prompts']} {prompts} (prompts) does not split over the {dp} data-parallel ranks "
                       f"(each rolls out {names['prompts']} / dp prompts)",
            f"use a batch of {round_up(prompts, dp)} prompts, or change the data-parallel size")
    if mini_batch % dp and not prompts % mini_batch and not prompts % dp:  # else said above already
        bad("mini_batch", f"the mini-batch of {mini_batch} prompts does not split over the {dp} data-parallel ranks "
                          f"(each updates on mini_batch / dp prompts x n={n} responses)",
            f"set {names['mini_batch']} to {choice}")
    if micro_share == "mini_batch" and not mini_batch % dp and not prompts % mini_batch and micro_batch >= 1:
        share = mini_batch * n // dp
        if share % micro_batch:
            sizes = ", ".join(map(str, divisors(share, upto=MAX_BATCH)[:8]))
            bad("micro_batch", f"{who} splits each rank's share of a mini-batch ({names['mini_batch']} {mini_batch} "
                               f"prompts x n={n} / {dp} data-parallel ranks = {share} responses) into whole "
                               f"micro-batches: {share} is not a multiple of {names['micro_batch']} {micro_batch}",
                f"set {names['micro_batch']} to one of {sizes}, or change {names['mini_batch']} / "
                f"{names['n']} so the share divides")
    if world and not prompts % dp and prompts * n % world:
        bad("prompts", f"{who} needs the step's responses ({names['prompts']} {prompts} x n={n} = {prompts * n}) "
                       f"to split over all {world} devices (real_train_batch_size % n_gpus)",
            f"use a batch of {round_up(prompts, math.lcm(dp, world // math.gcd(world, n)))} prompts, or change "
            f"{names['n']}")
    def whole_micro_batches(field: str, micro: int, ranks: int, whose: str, ranks_are: str, other: str = ""):
        """Each of `ranks` ranks' share of the step's responses in whole `micro` micro-batches."""
        share = prompts // ranks * n
        if share % micro:
            sizes = ", ".join(map(str, divisors(share, upto=MAX_BATCH)[:8]))
            bad(field, f"{who} splits {whose} ({names['prompts']} {prompts} prompts / {ranks} {ranks_are} x n={n} "
                       f"= {share} responses) into whole micro-batches: {share} is not a multiple of "
                       f"{names[field]} {micro}", f"set {names[field]} to one of {sizes}{other}")

    if micro_share == "rollout" and not prompts % dp and micro_batch >= 1:
        whole_micro_batches("micro_batch", micro_batch, dp, "each rank's rollout share", "data-parallel ranks")
    if rollout_dp and prompts % rollout_dp:
        bad("prompts", f"{names['prompts']} {prompts} (prompts) does not split over the generation's {rollout_dp} "
                       f"data-parallel ranks (devices / (the generation's tp x pp))",
            f"use a batch of {round_up(prompts, rollout_dp)} prompts, or change {names['rollout_tp']}")
    if ref_dp and prompts % ref_dp and not prompts % dp:  # (a batch over no dp is said above)
        bad("prompts", f"{who} splits the reference's forward passes by prompt over its own {ref_dp} data-parallel "
                       f"ranks: {names['prompts']} {prompts} (prompts) does not split over them",
            f"use a batch of {round_up(prompts, ref_dp)} prompts, or change the reference's tp / pp / cp")
    elif ref_dp and not prompts % ref_dp and ref_micro is not None and ref_micro >= 1:
        whole_micro_batches("ref_micro", ref_micro, ref_dp, "each reference rank's share",
                            "reference data-parallel ranks", ", or give the reference the actor's layout")
    return problems
