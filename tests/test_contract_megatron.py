"""backends.contract.megatron / .lora hold the Megatron and MindSpeed facts once: they match the upstream
reference data (../shared/upstream/megatron-mindspeed-flags.tsv), and what the two Megatron-flag engines
parse is built from them (backends.common.megatron_args)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.common import megatron_args
from backends.contract import lora, megatron
from tests.helpers.megatron_flags import ARCH, TSV_NAME, read_tsv

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = Path(os.environ.get("AF_UPSTREAM_DIR") or ROOT.parent / "shared" / "upstream")


@pytest.fixture(scope="module")
def tsv():
    if not (UPSTREAM / TSV_NAME).exists():
        pytest.skip(f"no upstream reference data at {UPSTREAM} (set AF_UPSTREAM_DIR)")
    return read_tsv(UPSTREAM / TSV_NAME)


def _declared(tsv, flag: str, source: str) -> dict:
    (d,) = [d for d in tsv[flag] if d["source"].startswith(source)]
    return d


def _literal(text: str):
    text = " ".join(text.split())
    return None if text in ("", "None") else ast.literal_eval(text)


def test_flag_table_is_megatrons_declaration(tsv):
    for name, flag in megatron.FLAGS.items():
        d = _declared(tsv, name, "megatron-core")
        if flag.switch:
            assert d["action"].strip("'") == ("store_false" if flag.off else "store_true"), name
            continue
        assert {"int": int, "float": float, "str": None, "": None}[d["type"]] is flag.type, name
        assert _literal(d["default"]) == flag.default, name
        assert _literal(d["choices"]) == (list(flag.choices) if flag.choices else None), name


# MindSpeed-MM's own flags (its arguments.py is not in the TSV): --mm-tool names its profiler settings file
NOT_IN_TSV = {"--mm-tool", "--log-tps"}


def test_no_effect_flags_are_upstream_flags_that_change_no_number(tsv):
    assert {name for name in megatron.NO_EFFECT if name not in tsv} == NOT_IN_TSV
    for name, entry in megatron.NO_EFFECT.items():
        assert entry.why and set(entry.dialects) <= {"llm", "mm"}, name
        assert entry.declared == (name in megatron.FLAGS), name   # the shared table parses those
        for d in tsv.get(name, []):  # every upstream declaration, as the engines parse it
            if not entry.takes_value:
                assert d["action"].strip("'\"") in ("store_true", "store_false"), name
            elif not entry.declared:
                assert {"int": int, "float": float, "str": None, "": None}[d["type"]] is entry.type, name
                if entry.choices:
                    assert set(_literal(d["choices"])) <= set(entry.choices), name
    assert megatron.NO_EFFECT["--mm-tool"].takes_value and megatron.NO_EFFECT["--mm-tool"].dialects == ("mm",)
    # flags with a meaning never land here: the architecture facts held against the model
    from backends.llm import config as llm

    assert not set(megatron.no_effect("llm")) & set(llm.MODEL_FACTS)


# flags an engine parses only at values that change nothing (one choice), refusing the rest elsewhere
ONE_CHOICE = {"mm": {"--context-parallel-algo": "ulysses only, and --context-parallel-size other than 1 is refused",
                     "--tokenizer-type": "NullTokenizer only: the tokenizer is model.json's"}}


@pytest.mark.parametrize("engine", ["llm", "mm"])
def test_every_flag_is_read_or_noticed(engine):
    """No flag of backends.llm / backends.mm is parsed and dropped: each dest is read by the engine (ns.<dest>
    or its name in a flag table), refused as an architecture switch when omitted (llm), parsed at one
    harmless choice only, or a no-effect notice."""
    import importlib
    import re

    config = importlib.import_module(f"backends.{engine}.config")
    # the engine's modules, and the shared reader of its tracker flags (trackers.megatron_flag_settings)
    src = "".join(p.read_text() for p in [*(ROOT / "backends" / engine).glob("*.py"),
                                          ROOT / "backends" / "common" / "trackers.py"])
    excused = set(megatron.no_effect(engine)) | set(ONE_CHOICE.get(engine, {}))
    excused |= {flag for flags in getattr(config, "ARCHITECTURE_SWITCHES", {}) for flag in flags}
    unread = [a.option_strings[0] for a in config._parser()._actions if a.option_strings and a.dest != "help"
              and a.option_strings[0] not in excused
              and not re.search(rf"\b(ns|args)\.{a.dest}\b|[\"']{a.dest}[\"']", src)]
    assert unread == []


def test_engines_narrow_upstream_choices_only(tsv):
    for name, built in megatron_args.BUILT.items():
        if "choices" in built:
            assert set(built["choices"]) <= set(megatron.FLAGS[name].choices), name
            assert built.get("default", megatron.FLAGS[name].default) in built["choices"], name


def test_context_parallel_algorithms(tsv):
    assert set(megatron.CP_ALGO_NAMES.values()) == set(megatron.CP_ALGO_FLAGS)
    for source, default in (("mindspeed", megatron.CP_ALGO_DEFAULT_MINDSPEED),
                            ("mindspeed-llm", megatron.CP_ALGO_DEFAULT_MINDSPEED_LLM)):
        d = [d for d in tsv["--context-parallel-algo"] if d["source"] == source][0]
        assert _literal(d["default"]) == default
    listed = {c for d in tsv["--context-parallel-algo"] for c in _literal(d["choices"])}
    assert set(megatron.CP_ALGO_NAMES) <= listed


def test_lora_groups_cover_every_architecture():
    assert list(lora.MODULE_LINEARS) == list(lora.MODULES)
    for arch in ({}, {"mla": {"q_lora_rank": 8}}, {"mla": {"q_lora_rank": None, "kv_lora_rank": 8}}):
        for module, names in lora.lora_groups(arch).items():
            assert set(names) <= set(lora.MODULE_LINEARS[module])
    assert lora.FUSED_ALIASES["gate_up_proj"] in lora.MODULE_LINEARS


def test_engine_parsers_take_the_shared_flags_as_declared():
    from backends.llm import config as llm
    from backends.mm import config as mm

    for engine in (llm, mm):
        actions = {a.option_strings[0]: a for a in engine._parser()._actions if a.option_strings}
        for name, flag in megatron.FLAGS.items():
            built = megatron_args.BUILT.get(name, {})
            action = actions[name]
            assert action.type is flag.type and action.required is built.get("required", False), name
            assert action.default == built.get("default", flag.off if flag.switch else flag.default), name
        dialect = engine.__name__.split(".")[1]
        assert megatron.no_effect(dialect)
        for name, entry in megatron.no_effect(dialect).items():
            assert actions[name].nargs == (entry.nargs if entry.takes_value else 0), name
    llm_flags, mm_flags = set(llm.supported_flags()), set(mm.supported_flags())
    assert "--mm-tool" in mm_flags and "--mm-tool" not in llm_flags            # MindSpeed-MM's own
    assert "--moe-alltoall-overlap-comm" in llm_flags - mm_flags


def test_no_effect_flags_print_one_notice_line_each(capsys, monkeypatch):
    from backends.llm.config import parse_args

    base = [*ARCH, "--data-path", "x", "--split", "100,0,0", "--seq-length", "8", "--global-batch-size", "1", "--lr", "1e-4",
            "--train-iters", "1"]
    given = ["--no-rope-fusion", "--no-check-for-nan-in-loss-and-grad", "--use-cp-send-recv-overlap",
             "--no-rope-fusion", "--use-fused-ring-attention-update", "--no-gradient-accumulation-fusion"]
    monkeypatch.delenv("RANK", raising=False)
    parse_args(base + given, engine={"model_id": "qwen3-0.6b"})
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": notice: ")[1].split()[0] for line in lines] == list(dict.fromkeys(given))
    assert all(line.startswith("python -m backends.llm: notice: ") and "no effect" in line for line in lines)
    assert "fusion" in lines[0] and "NaN" in lines[1]
    monkeypatch.setenv("RANK", "1")   # the other ranks stay quiet
    parse_args(base + given, engine={"model_id": "qwen3-0.6b"})
    assert capsys.readouterr().err == ""
    assert megatron_args.notices(["--mm-tool", "tools.json", "--log-tps"], "mm") == [
        f"notice: --mm-tool has no effect on this engine ({megatron.NO_EFFECT['--mm-tool'].why})",
        f"notice: --log-tps has no effect on this engine ({megatron.NO_EFFECT['--log-tps'].why})"]
    assert megatron_args.notices(["--mm-tool", "t.json", "--lr", "1"], "llm") == []


def test_contract_imports_only_the_standard_library():
    code = ("import sys; import backends.contract.layout, backends.contract.lora, backends.contract.megatron; "
            "ours = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ascendfactory', 'numpy', 'yaml') or "
            "(m.startswith('backends.') and not m.startswith('backends.contract'))]; "
            "assert not ours, ours; import backends.common.megatron_args; "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.split('.')[:2] in [['backends', e] "
            "for e in ('llm', 'mm', 'lf', 'rl', 'models')]]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


# where an engine's default is not upstream's, and why the difference cannot change a run: each needs a reason
NOT_UPSTREAM_DEFAULT = {
    "--micro-batch-size": "Megatron has no default (None fails its checks); 1 is what scripts that leave it out meant",
    "--normalization": "LayerNorm is not built: the native decoders' norm is RMSNorm, the model's own",
    "--position-embedding-type": "learned absolute positions are not built: the native decoders are rope models",
    "--moe-token-dispatcher-type": "the dispatcher moves tokens, the experts compute the same (allgather is "
                                   "refused with expert parallel, where alltoall runs)",
    "--cp-attention-mask-type": "MindSpeed-LLM's None reads as causal",
    "--handler-name": "MindSpeed-LLM's '' is its GeneralPretrainHandler",
}


def test_omitted_flags_read_as_upstream_defaults(tsv):
    """Every flag both engines parse that upstream declares with one default takes that default when left out
    (the architecture flags the model supplies default to None: the model's own value)."""
    from backends.llm import config as llm
    from backends.mm import config as mm

    for engine in (llm, mm):
        for action in engine._parser()._actions:
            name = next((o for o in action.option_strings if o in tsv), None)
            if name is None or action.nargs == 0 or action.default is None or name in NOT_UPSTREAM_DEFAULT:
                continue
            upstream = {repr(_literal(d["default"])) for d in tsv[name]}
            assert repr(action.default) in upstream, (engine.__name__, name, action.default, upstream)
    for name, value in (("--weight-decay", 0.01), ("--clip-grad", 1.0), ("--adam-beta2", 0.999),
                        ("--lr-decay-style", "linear"), ("--log-interval", 100), ("--adam-eps", 1e-8)):
        assert _literal(_declared(tsv, name, "megatron-core")["default"]) == value   # the list, as read
