"""torchrun worker of tests/llm/test_loading.py (no tests here): builds tiny decoders on the meta
device, applies a parallel layout on meta, materialises them with backends.models.decoder.loading and
reports, per case, how every local shard compares with the same region of the one-process model,
how many bytes each rank read against its share, and whether the shard-by-shard HF export equals
the source checkpoint.

    python -m torch.distributed.run --nproc-per-node N tests/llm/test_loading_worker.py LAYOUT CASES_JSON OUT

LAYOUT: tp2 | pp2 | fsdp2 | ep2 | tp2xfsdp2. CASES_JSON: [{"name", "family", "model_dir" or null,
"lora": bool}]. Every rank writes OUT.<rank>.json.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def layout_of(name: str, world: int) -> dict:
    lay = {"tp2": dict(tp=2, pp=1, fsdp=False, ep=1), "pp2": dict(tp=1, pp=2, fsdp=False, ep=1),
           "fsdp2": dict(tp=1, pp=1, fsdp=True, ep=1), "ep2": dict(tp=1, pp=1, fsdp=False, ep=2),
           "tp2xfsdp2": dict(tp=2, pp=1, fsdp=True, ep=1)}[name]
    return {**lay, "dp": world // (lay["tp"] * lay["pp"])}


def build(case: dict, lay: dict, mesh, seed: int):
    """-> (decoder, reader, par) with the layout applied on meta, then materialised."""
    from backends.common.checkpoint.hf_io import read_config
    from backends.models.decoder import loading
    from backends.models.decoder import ModelConfig, card_config

    if case["model_dir"]:
        cfg = ModelConfig.from_hf(read_config(case["model_dir"]))
    else:
        cfg = card_config(case["card"], **case["overrides"])
    decoder = loading.meta_decoder(cfg)
    if case["lora"]:
        from backends.common.lora import inject_lora

        inject_lora(decoder, r=4, alpha=8.0, targets=["all"])
    par = SimpleNamespace(layout=SimpleNamespace(tp=lay["tp"], pp=lay["pp"]), mesh=mesh, dp_rank=0, cp_rank=0,
                          pp_rank=0, pp_group=None)
    if mesh is not None:
        par.dp_rank = mesh["dp"].get_local_rank()
    if lay["tp"] > 1:
        from backends.models.decoder.tp_plan import apply_tensor_parallel

        apply_tensor_parallel(decoder, mesh["tp"])
    if lay["ep"] > 1:
        from backends.common.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(decoder, mesh["dp"], aux_loss="local")
    if lay["pp"] > 1:
        from backends.common.parallel.pipeline import plan_pipeline, prune_to_rank

        par.pp_rank, par.pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
        plan = plan_pipeline(cfg.num_layers, lay["pp"], par.pp_rank)
        prune_to_rank(decoder.parts(), [i for s in plan.stage_ids for i in plan.layers[s]], first=plan.first_rank,
                      last=plan.last_rank)
    if lay["fsdp"]:
        from torch.distributed.fsdp import fully_shard

        from backends.common.parallel.expert_parallel import expert_parameters

        ignored = set(expert_parameters(decoder)) or None
        for layer in decoder.model.layers:
            fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
        fully_shard(decoder, mesh=mesh["dp"], ignored_params=ignored)
    reader = loading.materialize(decoder, decoder, "cpu", hf_dir=case["model_dir"], seed=seed)
    return decoder, reader, par


def one_process(case: dict, seed: int):
    """The whole model on this rank alone: the old whole-checkpoint load, or the seeded init unsharded."""
    from backends.models import decoder as models

    if case["model_dir"] and not case["lora"]:
        return models.from_pretrained(case["model_dir"])
    lay = dict(tp=1, pp=1, fsdp=False, ep=1)
    decoder, _, _ = build(case, lay, None, seed)
    return decoder


def stored(reference: torch.nn.Module, decoder, name: str) -> torch.Tensor:
    """The one-process tensor in the layout the sharded parameter stores (pair-interleaved under TP)."""
    from backends.common.parallel.tensor_parallel import _to_paired

    ref = dict(reference.named_parameters()) | dict(reference.named_buffers())
    t = ref[name].detach()
    dim = getattr(decoder, "_tp_paired", {}).get(name)
    return _to_paired(t, dim) if dim is not None else t


def check(case: dict, lay: dict, mesh, tmp: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from backends.models.decoder import loading
    from backends.models.decoder.convert import hf_state_dict

    seed = 11
    decoder, reader, par = build(case, lay, mesh, seed)
    reference = one_process(case, seed)
    worst, share = 0.0, 0
    names = []
    for name, t in [*decoder.named_parameters(), *loading.persistent_buffers(decoder)]:
        names.append(name)
        region = loading.local_region(t)
        local = t.to_local() if isinstance(t, DTensor) else t
        want = stored(reference, decoder, name)[tuple(slice(a, b) for a, b in region)]
        worst = max(worst, float((local.detach() - want).abs().max()) if local.numel() else 0.0)
        if not loading._lora_part(name):
            share += local.numel() * 4  # the tiny checkpoints are fp32
    out = {"worst": worst, "names": sorted(names), "local_numel": sum(
        (t.to_local() if isinstance(t, DTensor) else t).numel() for t in decoder.parameters())}
    if reader is not None:
        out.update(bytes_read=reader.bytes_read, share=share,
                   checkpoint_bytes=sum(v.numel() * v.element_size() for v in load_file(
                       f"{case['model_dir']}/model.safetensors").values()))
    # the shard-by-shard export: every rank takes part, rank 0 writes
    target = f"{tmp}/{case['name']}-export"
    lora = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, targets=["all"], merge_on_export=True) \
        if case["lora"] else None
    loading.export_hf(decoder, par, target, lora=lora, max_shard_bytes=64 * 1024)
    if dist.get_rank() == 0:
        from backends.common.checkpoint.hf_io import read_safetensors

        written = read_safetensors(target if lora is None else f"{target}/merged")
        if lora is None:
            want = hf_state_dict(reference)
        else:
            from backends.common.lora import merge_lora

            want = hf_state_dict(merge_lora(reference))
        if reference.config.tie_word_embeddings:
            want.pop("lm_head.weight", None)
        out["export_keys_equal"] = sorted(written) == sorted(want)
        out["export_worst"] = max(float((written[k] - want[k]).abs().max()) for k in want if k in written)
        out["export_files"] = len({str(written.file_of(k)) for k in written})
        if lora is not None:
            adapter = load_file(f"{target}/adapter/adapter_model.safetensors")
            from backends.common.lora import PEFT_PREFIX, lora_state_dict

            ref_adapter = lora_state_dict(one_process(case, seed))
            out["adapter_worst"] = max(float((adapter[PEFT_PREFIX + k] - v).abs().max())
                                       for k, v in ref_adapter.items())
            out["adapter_keys_equal"] = sorted(adapter) == sorted(PEFT_PREFIX + k for k in ref_adapter)
    return out


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers.dist_exit import leave

    layout, cases_json, out = sys.argv[1:4]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    lay = layout_of(layout, world)
    mesh = init_device_mesh("cpu", (lay["pp"], lay["dp"], lay["tp"]), mesh_dim_names=("pp", "dp", "tp"))
    results, failure = {}, None
    try:
        for case in json.loads(cases_json):
            results[case["name"]] = check(case, lay, mesh, str(__import__("pathlib").Path(out).parent))
    except Exception:  # noqa: BLE001 - reported by the test
        import traceback

        failure = traceback.format_exc()
    with open(f"{out}.{dist.get_rank()}.json", "w") as fh:
        json.dump(results, fh)
    leave(failure)


if __name__ == "__main__":
    main()
