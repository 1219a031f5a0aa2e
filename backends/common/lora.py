"""LoRA on native ``nn.Linear`` layers, with PEFT-compatible adapter files.

``inject_lora`` swaps the chosen ``nn.Linear`` modules for :class:`LoRALinear` (the original layer
kept, frozen, as ``.base_layer``; ``lora_A``/``lora_B`` as bias-free ``nn.Linear`` children), so
parameter names are PEFT's minus the adapter-name segment::

    model.layers.0.self_attn.q_proj.base_layer.weight
    model.layers.0.self_attn.q_proj.lora_A.weight      # (r, in),  kaiming-uniform(a=sqrt(5))
    model.layers.0.self_attn.q_proj.lora_B.weight      # (out, r), zeros

``save_peft_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained(hf_model, dir)`` loads (keys ``base_model.model.<path>.lora_A.weight``),
``load_peft_adapter`` reads them back (also files written by PEFT), ``merge_lora`` folds the
adapters into plain ``nn.Linear`` weights for a merged full-weight export.

Parallelism is applied outside (FSDP2 / TP wrap the LoRA modules like any other); the save/load
helpers gather/scatter DTensor parameters, and must then be called on every rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

__all__ = [
    "LoRALinear",
    "init_lora_weight",
    "inject_lora",
    "lora_delta",
    "lora_modules",
    "lora_state_dict",
    "base_state_dict",
    "save_peft_adapter",
    "load_peft_adapter",
    "merge_lora",
    "linear_names",
    "PEFT_PREFIX",
]

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# wrapper segments that appear in module names but not in the model's own (HF) names
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_OUTPUT_LEAVES = {"lm_head", "output", "output_layer", "embed_out"}
_GATE_RE = re.compile(r"(^|_)(gate|router)$")  # MoE router gates (not gate_proj)
_LAYER_RE = re.compile(r"(^|\.)(layers|layer|h|blocks)\.\d+\.")


@torch.no_grad()
def init_lora_weight(which: str, weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """PEFT's init of an adapter weight: lora_A kaiming-uniform(a=sqrt(5)), lora_B zeros. A generator
    seeded per parameter (instead of the global RNG) makes the draw independent of the layout."""
    if which == "lora_A":
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
    elif which == "lora_B":
        nn.init.zeros_(weight)
    else:
        raise ValueError(f"init_lora_weight: {which!r} is neither lora_A nor lora_B")


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling * B @ A`` in fp32: what merging adds to the base weight."""
    return (b.float() @ a.float()) * scaling


class LoRALinear(nn.Module):
    """``base(x) + lora_B(lora_A(dropout(x))) * scaling`` with ``scaling = alpha / r``."""

    def __init__(self, base_layer: nn.Linear, r: int, alpha: float, dropout: float = 0.0,
                 lora_dtype: torch.dtype | None = None):
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"LoRALinear wraps nn.Linear, got {type(base_layer).__name__}")
        if int(r) <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {r}")
        self.base_layer = base_layer
        self.r = int(r)
        self.lora_alpha = alpha
        self.scaling = alpha / self.r
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        weight = base_layer.weight
        if lora_dtype is None:  # PEFT's autocast_adapter_dtype: half-precision bases get fp32 adapters
            lora_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        factory = {"device": weight.device, "dtype": lora_dtype}
        self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, self.r, bias=False, **factory)
        self.lora_B = nn.Linear(self.r, self.out_features, bias=False, **factory)
        for p in base_layer.parameters():
            p.requires_grad_(False)
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        init_lora_weight("lora_A", self.lora_A.weight)
        init_lora_weight("lora_B", self.lora_B.weight)

    # the base layer's attributes, for code that inspects q_proj.weight / .bias
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        lora_x = x.to(self.lora_A.weight.dtype)
        delta = self.lora_B(self.lora_A(self.lora_dropout(lora_x))) * self.scaling
        return result + delta.to(result.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` in fp32 (full tensors; not for sharded DTensor parameters)."""
        return lora_delta(self.lora_A.weight, self.lora_B.weight, self.scaling)

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha}, scaling={self.scaling:g}"


# --------------------------------------------------------------------------- names


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return getattr(model, "_orig_mod", model)


def _clean(name: str) -> str:
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _output_module_names(model: nn.Module) -> set[str]:
    names = set()
    out = None
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            out = get()
        except Exception:  # pragma: no cover - models that do not implement it
            out = None
    for name, module in model.named_modules():
        if (out is not None and module is out) or _leaf(name) in _OUTPUT_LEAVES:
            names.add(name)
    return names


def _plain_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(name, module) for every adaptable nn.Linear (not already inside a LoRALinear)."""
    inside_lora = set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            inside_lora.update(n for n, _ in module.named_modules(prefix=name))
    found = []
    for name, module in model.named_modules():
        if name in inside_lora or not isinstance(module, nn.Linear):
            continue
        if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
            continue  # nn.MultiheadAttention reads out_proj.weight directly
        found.append((name, module))
    return found


def linear_names(model: nn.Module) -> list[str]:
    """Full names of the adaptable nn.Linear modules."""
    return [n for n, _ in _plain_linears(_unwrap(model))]


def _all_linear_targets(model: nn.Module, linears: list[tuple[str, nn.Linear]]) -> list[str]:
    """PEFT 'all-linear': every linear in the decoder layers except the output layer and routers."""
    excluded = _output_module_names(model)
    names = [n for n, _ in linears if n not in excluded and not _GATE_RE.search(_leaf(n))]
    in_layers = [n for n in names if _LAYER_RE.search(n + ".")]
    return in_layers or names


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _select(model: nn.Module, targets, linears) -> list[str]:
    if isinstance(targets, str):
        targets = [targets]
    targets = [str(t).strip() for t in targets]
    if not targets:
        raise ValueError("inject_lora: empty target list (use ['all'] for every linear layer)")
    if any(t.lower() in ("all", "all-linear", "all_linear") for t in targets):
        if len(targets) > 1:
            raise ValueError(f"inject_lora: 'all' cannot be combined with other targets: {targets}")
        return _all_linear_targets(model, linears)
    chosen, unmatched = [], []
    names = [n for n, _ in linears]
    for t in targets:
        hits = [n for n in names if _matches(_clean(n), t)]
        if not hits:
            unmatched.append(t)
        chosen += hits
    if unmatched:
        available = sorted({_leaf(n) for n in names})
        raise ValueError(
            f"LoRA target(s) {unmatched} match no nn.Linear in {type(model).__name__}; "
            f"available linear names: {available} (or 'all' for every linear in the decoder layers)"
        )
    chosen_set = set(chosen)
    return [n for n in names if n in chosen_set]  # model order


# --------------------------------------------------------------------------- inject


def inject_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0,
                targets: Iterable[str] | str = ("all",), *,
                lora_dtype: torch.dtype | None = None) -> list[str]:
    """Wrap the target linears in :class:`LoRALinear`, freeze everything else.

    ``targets``: module-name suffixes (``q_proj``, ``mlp.down_proj``, full paths, ...) or
    ``['all']`` (every nn.Linear in the decoder layers except the output layer and MoE router
    gates). Returns the adapted module names (as ``model.named_modules`` spells them).
    """
    root = _unwrap(model)
    if lora_modules(root):
        raise ValueError("inject_lora: the model already has LoRA adapters")
    linears = _plain_linears(root)
    chosen = _select(root, targets, linears)
    by_name = dict(linears)
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        lora = LoRALinear(by_name[name], r, alpha, dropout, lora_dtype=lora_dtype)
        lora.train(by_name[name].training)  # an eval-mode model stays in eval mode
        setattr(parent, leaf, lora)
    for pname, p in root.named_parameters():
        p.requires_grad_(".lora_A." in f".{pname}" or ".lora_B." in f".{pname}")
    return chosen


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """{clean module path: LoRALinear}."""
    return {_clean(n): m for n, m in _unwrap(model).named_modules() if isinstance(m, LoRALinear)}


# --------------------------------------------------------------------------- state dicts


def _full(t: torch.Tensor) -> torch.Tensor:
    """A full, plain CPU tensor (DTensor: gathered — collective)."""
    t = t.detach()
    if hasattr(t, "full_tensor") and type(t).__name__ == "DTensor":
        t = t.full_tensor()
    return t.cpu().contiguous().clone()


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{<module path>.lora_A.weight: tensor, ...}`` (full CPU tensors; collective under DTensor)."""
    out = {}
    for path, mod in lora_modules(model).items():
        out[f"{path}.lora_A.weight"] = _full(mod.lora_A.weight)
        out[f"{path}.lora_B.weight"] = _full(mod.lora_B.weight)
    return out


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its original (pre-LoRA) names, without the adapters."""
    out = {}
    for k, v in _unwrap(model).state_dict().items():
        k = _clean(k)
        if ".lora_A." in k or ".lora_B." in k:
            continue
        out[k.replace(".base_layer.", ".")] = v
    return out


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dist_barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _single(values: set, what: str):
    if len(values) != 1:
        raise ValueError(f"save_peft_adapter: the LoRA modules disagree on {what}: {sorted(values)}")
    return next(iter(values))


def _atomic_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def save_peft_adapter(model: nn.Module, out_dir: str | os.PathLike,
                      base_model_name_or_path: str | None = None, r: int | None = None,
                      alpha: float | None = None, dropout: float | None = None,
                      target_modules: Iterable[str] | str | None = None, *, collective: bool = True) -> Path:
    """Write a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``r``/``alpha``/``dropout`` default to the injected modules' values (and must agree with
    them when given). ``target_modules``: the suffixes given to :func:`inject_lora`; None or
    ``'all'`` writes the exact adapted module paths (as PEFT does for ``all-linear``).
    Collective under torch.distributed (rank 0 writes), unless ``collective=False``: then the caller
    writes a local model from one rank and no other rank takes part. Each file is written to a temporary name
    and renamed, the config last, so a directory with a config always has its weights.
    """
    from safetensors.torch import save_file

    mods = lora_modules(model)
    if not mods:
        raise ValueError("save_peft_adapter: the model has no LoRA modules (call inject_lora first)")
    m_r = _single({m.r for m in mods.values()}, "r")
    m_alpha = _single({m.lora_alpha for m in mods.values()}, "alpha")
    m_drop = _single({m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0
                      for m in mods.values()}, "dropout")
    for given, actual, what in ((r, m_r, "r"), (alpha, m_alpha, "alpha"), (dropout, m_drop, "dropout")):
        if given is not None and float(given) != float(actual):
            raise ValueError(f"save_peft_adapter: {what}={given} but the injected LoRA modules have {what}={actual}")
    if target_modules is None or (isinstance(target_modules, str) and target_modules.lower() in ("all", "all-linear")) \
            or (not isinstance(target_modules, str) and [str(t).lower() for t in target_modules] in (["all"], ["all-linear"])):
        targets: Any = sorted(mods)
    elif isinstance(target_modules, str):
        targets = [target_modules]
    else:
        targets = sorted({str(t) for t in target_modules})

    tensors = {PEFT_PREFIX + k: v for k, v in lora_state_dict(model).items()}  # collective on DTensors
    out = Path(out_dir)
    if not collective or _dist_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": m_r,
            "lora_alpha": m_alpha,
            "lora_dropout": m_drop,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": False,
            "base_model_name_or_path": None if base_model_name_or_path is None else str(base_model_name_or_path),
            "inference_mode": True,
            "init_lora_weights": True,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": None,
        }
        tmp_w = out / f".{ADAPTER_WEIGHTS}.tmp{os.getpid()}"
        save_file(tensors, str(tmp_w), metadata={"format": "pt"})
        _atomic_replace(tmp_w, out / ADAPTER_WEIGHTS)
        tmp_c = out / f".{ADAPTER_CONFIG}.tmp{os.getpid()}"
        tmp_c.write_text(json.dumps(config, indent=2) + "\n")
        _atomic_replace(tmp_c, out / ADAPTER_CONFIG)
    if collective:
        _dist_barrier()
    return out


# --------------------------------------------------------------------------- load


def _peft_targets(target_modules) -> list[str] | str:
    if target_modules is None:
        raise ValueError("adapter_config.json has no target_modules")
    if isinstance(target_modules, str):
        return ["all"] if target_modules.lower() == "all-linear" else target_modules
    return list(target_modules)


@torch.no_grad()
def _copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    if type(param).__name__ == "DTensor":
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements)
        param.copy_(value)
    else:
        param.copy_(value.to(param.device, param.dtype))


def load_peft_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> list[str]:
    """Load a PEFT LoRA adapter into ``model`` (injecting LoRA from its config first when the
    model has none). Returns the loaded module paths. Missing/unexpected keys and shape
    mismatches raise one ValueError naming the directory."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg_path, w_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"LoRA adapter {adapter_dir}: missing {p.name}")
    cfg = json.loads(cfg_path.read_text())
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {adapter_dir}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise ValueError(f"LoRA adapter {adapter_dir}: {key}=true is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {adapter_dir}: rank_pattern/alpha_pattern are not supported")
    r, alpha = int(cfg["r"]), cfg.get("lora_alpha", 8)

    mods = lora_modules(model)
    if not mods:
        targets = _peft_targets(cfg.get("target_modules"))
        if isinstance(targets, str):  # a PEFT regex: full match on module names
            targets = [n for n in linear_names(model) if re.fullmatch(targets, _clean(n))]
        inject_lora(model, r, alpha, float(cfg.get("lora_dropout", 0.0)), targets)
        mods = lora_modules(model)

    raw = load_file(str(w_path))
    state = {}
    for k, v in raw.items():
        k = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        k = k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        state[k] = v
    problems, missing = [], []
    for path, mod in mods.items():
        if mod.r != r or float(mod.lora_alpha) != float(alpha):
            problems.append(f"{path}: model r={mod.r} alpha={mod.lora_alpha}, adapter r={r} alpha={alpha}")
        for part in ("lora_A", "lora_B"):
            key = f"{path}.{part}.weight"
            if key not in state:
                missing.append(key)
                continue
            want = tuple(getattr(mod, part).weight.shape)
            if tuple(state[key].shape) != want:
                problems.append(f"{key}: adapter {list(state[key].shape)} vs model {list(want)}")
    expected = {f"{p}.{part}.weight" for p in mods for part in ("lora_A", "lora_B")}
    unexpected = sorted(set(state) - expected)
    if missing:
        problems.append(f"{len(missing)} key(s) missing from the adapter: {missing[:6]}")
    if unexpected:
        problems.append(f"{len(unexpected)} adapter key(s) the model has no LoRA module for: {unexpected[:6]}")
    if problems:
        raise ValueError(f"LoRA adapter {adapter_dir} does not fit the model: " + "; ".join(problems))
    for path, mod in mods.items():
        _copy_into(mod.lora_A.weight, state[f"{path}.lora_A.weight"])
        _copy_into(mod.lora_B.weight, state[f"{path}.lora_B.weight"])
    return list(mods)


# --------------------------------------------------------------------------- merge


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by its base nn.Linear with ``W + scaling * B @ A`` (in place).

    Needs full (unsharded) parameters: gather an FSDP/TP model first. Returns the model.
    """
    root = _unwrap(model)
    for name, mod in [(n, m) for n, m in root.named_modules() if isinstance(m, LoRALinear)]:
        base = mod.base_layer
        if type(base.weight).__name__ == "DTensor" or type(mod.lora_A.weight).__name__ == "DTensor":
            raise ValueError(f"merge_lora: {name} is sharded (DTensor); merge a gathered full model")
        merged = base.weight.float() + mod.delta_weight().to(base.weight.device)
        base.weight.copy_(merged.to(base.weight.dtype))
        parent_name, _, leaf = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, leaf, base)
    return model
