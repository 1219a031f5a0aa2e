"""MindSpeed-LLM's FSDP2 dialect (`python -m backends.llm <file>.yaml --section.key value …`): the key table
held against upstream's arguments.py (tests/fixtures/upstream/mindspeed-llm/fsdp2/arguments.tsv), its
parser's type rules, and the published pairs read as train_fsdp2.py reads them."""

import ast
import csv
import hashlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from backends.llm.fsdp2.config import FSDP2ConfigError, merged_args, parse_args, parse_command
from backends.llm.fsdp2.keys import KEYS, REQUIRED, Notice, Refuse, Use

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "tests/fixtures/upstream/mindspeed-llm/fsdp2"
TUNE = UPSTREAM / "tune_qwen3_8b_4k_fsdp2_A2.yaml"
NEEDED = ["--model.model_name_or_path", "/m", "--training.output_dir", "/o"]


def _upstream_rows():
    with (UPSTREAM / "arguments.tsv").open(encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def _kind(annotation: str):
    """Our kind for an upstream annotation, by the rules of its _create_argument_parser."""
    node = ast.parse(annotation, mode="eval").body
    optional = isinstance(node, ast.Subscript) and ast.unparse(node.value) == "Optional"
    if optional:
        node = node.slice
    head = ast.unparse(node.value) if isinstance(node, ast.Subscript) else ast.unparse(node)
    if head == "Literal":
        return tuple(ast.literal_eval(e) for e in node.slice.elts) if isinstance(node.slice, ast.Tuple) \
            else (ast.literal_eval(node.slice),)
    if head == "Union":
        return "json"
    if head == "List":
        return "list:" + ast.unparse(node.slice)
    return head + ("?" if optional and head == "bool" else "")


def _blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_every_upstream_key_has_its_type_default_and_a_treatment():
    # the fixtures are upstream's bytes (SOURCE.md's blob ids), the table is what arguments.py's fields say
    rows = re.findall(r"^\| `([^`]+)` \| `[^`]+`[^|]* \| ([0-9a-f]{40}) \|$",
                      (UPSTREAM / "SOURCE.md").read_text(encoding="utf-8"), re.M)
    assert len(rows) == 9
    for name, blob in rows:
        assert _blob(UPSTREAM / name) == blob, name
    sys.path.insert(0, str(UPSTREAM))
    try:
        import make_key_table
    finally:
        sys.path.remove(str(UPSTREAM))
    rows = _upstream_rows()
    assert [tuple(r.values()) for r in rows] == make_key_table.rows()
    ours = {(s, k) for s, table in KEYS.items() for k in table}
    assert ours == {(r["section"], r["key"]) for r in rows}
    for r in rows:
        kind, default, how = KEYS[r["section"]][r["key"]]
        assert kind == _kind(r["type"]), r["key"]
        want = REQUIRED if r["default"] == "<required>" else ast.literal_eval(r["default"])
        assert default is want if want is REQUIRED else default == want, r["key"]
        assert isinstance(how, (Use, Notice, Refuse)), r["key"]


def _sh_command(name: str) -> list[str]:
    """The train_fsdp2.py arguments of a published .sh (its torchrun line)."""
    text = (UPSTREAM / name).read_text(encoding="utf-8").replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("torchrun"))
    words = shlex.split(line.split("|")[0])
    return words[words.index("train_fsdp2.py") + 1:]


def test_the_published_tune_pair_reads_as_upstream_and_refusals_name_the_key(tmp_path):
    argv = _sh_command("tune_qwen3_8b_4k_fsdp2_A2.sh")
    argv[0] = str(TUNE)
    cfg = parse_command(argv)
    # the command line wins over the file; the file over the defaults; YAML 1.1 reads 1e-05 as a string
    assert cfg.model.model_name_or_path == "/home/data/Qwen3-8B/" and cfg.data.dataset == "alpaca_full"
    assert cfg.parallel.fsdp_size == 8 and cfg.training.per_device_train_batch_size == 1
    assert cfg.training.lr == 1e-05 and cfg.training.max_steps == 2000 and cfg.parallel.recompute is True
    assert cfg.training.warmup_ratio == 0.0 and cfg.data.cutoff_len == 4096 and cfg.training.save_total_limit == 3
    assert sum(n.startswith("training.dataloader_num_workers: accepted") for n in cfg.notices) == 1
    # the MoE pretraining pair: Megatron data and stage pt are refused by name
    moe = [str(UPSTREAM / "pretrain_qwen3_30b_4k_fsdp2_A3.yaml"), *NEEDED]
    with pytest.raises(FSDP2ConfigError) as err:
        parse_command(moe)
    assert str(err.value).splitlines() == [
        "data.data_manager_type: 'mg' is not built here (data_manager_type mg (Megatron data) in this backend)",
        "training.stage: 'pt' is not built here (stage pt (pretraining goes through data_manager_type mg))"]


@pytest.mark.parametrize("extra, value", [
    (["--parallel.recompute"], True),                                # a bare flag is true
    (["--parallel.recompute", "n"], False),
    (["--training.max_steps", "-1"], -1),                            # a negative number is a value
    (["--data.dataset", '{"a": 1}'], {"a": 1}),                      # a JSON object, else the string
    (["--data.dataset={}"], None),
    (["--parallel.fsdp_modules", "a", "b"], ["a", "b"]),
    (["--training.num_train_epochs", "2"], 2.0),
])
def test_types_as_upstreams_parser(extra, value):
    name = extra[0][2:].split("=")[0]
    section, key = name.split(".")
    assert parse_args(NEEDED + extra).values[section][key] == value


def test_file_entries_skipped_only_when_the_command_line_gives_a_value():
    loaded = {"parallel": {"recompute": True, "fsdp_modules": ["x", "y"]}, "training": {"lr": "1e-05"}}
    assert merged_args(["--training.lr", "2"], loaded) == ["--training.lr", "2", "--parallel.recompute", "True",
                                                           "--parallel.fsdp_modules", "x", "y"]
    # upstream's quirk: a bare last flag has no "=" after it in the joined line, so the file's value follows and wins
    assert parse_args(NEEDED + merged_args(["--parallel.recompute"], {"parallel": {"recompute": False}})) \
        .values["parallel"]["recompute"] is False


def test_bad_input_one_line_per_key_exit_2_no_traceback(tmp_path, capsys):
    from backends.llm.fsdp2.recipe import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {model_name_or_path: /m}\ntraining: {output_dir: /o, lrr: 1, seed: x}\n"
                   "parallel: {cp_size: 2}\n")
    assert main([str(bad)]) == 2  # the engine's entry point (python -m backends.llm <file>.yaml)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x.removeprefix("backends.llm: error: ") for x in err.splitlines() if not x.startswith("(set AF")]
    assert lines == ["training.lrr: unknown key (did you mean --training.lr?)", "training.seed: 'x' is not an integer"]
    bad.write_text("model: {model_name_or_path: /m}\ntraining: {output_dir: /o}\nparallel: {cp_size: 2}\nmodle: {}\n")
    with pytest.raises(FSDP2ConfigError, match=r": modle: not a section of this dialect \(did you mean model\?\)"):
        parse_command([str(bad)])
    bad.write_text("model: {model_name_or_path: /m}\ntraining: {output_dir: /o}\nparallel: {cp_size: 2}\n")
    with pytest.raises(FSDP2ConfigError, match=r"^parallel.cp_size: 2 is not built here \(context parallel"):
        parse_command([str(bad)])


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_schedules_are_upstreams_scheduler_factory(style, monkeypatch):
    """Our schedule against upstream's SchedulerFactory itself (its scheduler.py, with its logger stubbed)."""
    import importlib.util
    import types

    import torch

    from backends.llm.fsdp2.recipe import lr_lambda

    logging_stub = types.ModuleType("mindspeed_llm.fsdp2.utils.logging")
    logging_stub.get_logger = lambda name: types.SimpleNamespace(info_rank0=print, debug_rank0=print)
    monkeypatch.setitem(sys.modules, "mindspeed_llm.fsdp2.utils.logging", logging_stub)
    spec = importlib.util.spec_from_file_location("upstream_scheduler", UPSTREAM / "scheduler.py")
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)

    total, ratio, lr, min_lr = 17.5, 0.2, 3e-4, 2e-5  # train_steps may be fractional (max_steps × epochs)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    ref = upstream.SchedulerFactory.create(ref_opt, total, lr, style, ratio, min_lr)
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    ours = torch.optim.lr_scheduler.LambdaLR(ours_opt, lr_lambda(style, int(total * ratio), total, min_lr / lr))
    for _ in range(22):  # past the end too
        assert ours.get_last_lr() == pytest.approx(ref.get_last_lr(), rel=1e-12, abs=0)
        ref_opt.step(), ref.step(), ours_opt.step(), ours.step()
