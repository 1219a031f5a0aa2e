"""The five framework capability files hold the seed's tables cell for cell.

`tests/data/seed_capabilities.txt` is a verbatim copy of `shared/seeds/000_7737d69a6e3a05fa.txt`
(the AscendFactory doc page "各模型支持的训练特性", flattened markdown on one line). This test parses
that text on its own -- it does not trust the YAML -- and compares every cell of
`capability_matrix/<framework>.yaml` with it.

Parsing: in the flattened text a row boundary is a pipe, blanks, pipe (`| |`); empty cells inside a
row are written without blanks (`||||`). So the text is cut back into markdown lines, the three
`|---|` separator lines start the three tables, the first line after a separator names the
framework column groups (`| Llama-Factory ||| MindSpeed-MM ||||`), the lines up to the first
`| **LLM` / `| **多模态` row are column headers (MindSpeed-LLM's header spans two lines), and the
data rows follow until the next table's `| 模型类型` header.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers.model_ids import MODEL_IDS

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "tests" / "data" / "seed_capabilities.txt"
MATRIX = ROOT / "capability_matrix"

# The seed's column groups -> framework ids (DESIGN.md "Frameworks").
FRAMEWORK_OF_GROUP = {
    "MindSpeed-LLM": "mindspeed-llm",
    "Llama-Factory": "llamafactory",
    "MindSpeed-MM": "mindspeed-mm",
    "VeRL": "verl",
    "MindSpeed-RL": "mindspeed-rl",
}

# Feature keys in table order and the kind of value each column holds.
FEATURES = {
    "mindspeed-llm": [("pretrain_full", "flag"), ("lora", "flag"), ("packing", "flag"),
                      ("flash_attention", "flag"), ("sptd", "flag"), ("long_seq", "flag"),
                      ("moe_parallel", "flag"), ("dynamic_seq_len", "flag")],
    "llamafactory": [("stages", "list"), ("zero", "flag"), ("flash_attention", "flag")],
    "mindspeed-mm": [("pretrain_full", "flag"), ("sptd", "flag"),
                     ("distributed_optimizer", "flag"), ("recompute", "flag")],
    "verl": [("methods", "list"), ("sglang", "version"), ("vllm", "version"),
             ("train_backend", "backend")],
    "mindspeed-rl": [("methods", "list"), ("vllm", "version"), ("megatron_backend", "flag"),
                     ("long_seq", "flag")],
}

# Rows per framework as the seed has them (combined Llama rows counted as two models each).
EXPECTED_ROW_COUNTS = {"mindspeed-llm": 35, "llamafactory": 27, "mindspeed-mm": 27,
                       "verl": 10, "mindspeed-rl": 10}


FLAGS = {"✅": "supported", "❌": "unsupported", "NA": "not_planned"}
FLAG_VALUES = set(FLAGS.values())
LIST_TOKENS = {"pt", "sft", "dpo", "grpo", "dapo", "ppo"}   # ascendfactory.spec.Stage
CELL_LEGEND = {"supported": "✅", "unsupported": "❌", "not_planned": "NA — never planned"}
TOP_LEVEL_KEYS = {"framework", "display_name", "source", "cell_legend", "features", "models"}
FEATURE_FIELDS = {"title", "covers", "seed_header"}


# --------------------------------------------------------------------------- YAML loading

class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    return yaml.load(text, Loader=UniqueKeyLoader)


def load_framework(framework: str) -> dict:
    return load_yaml((MATRIX / f"{framework}.yaml").read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- seed parsing

ROW_START = re.compile(r"\| \*\*(LLM|多模态)\s*\*\* \|")
SEPARATOR = re.compile(r"\|(?:-{3,}\|)+")


def seed_lines(text: str) -> list[str]:
    """Cut the flattened markdown back into lines at each `| |` row boundary."""
    return [line.strip() for line in re.sub(r"\|[ \t]+\|", "|\n|", text).split("\n")]


def split_cells(line: str) -> list[str]:
    """Cells of one markdown line; prose before the first or after the last pipe is dropped."""
    body = line[line.index("|"): line.rindex("|") + 1]
    return [cell.strip() for cell in body.split("|")[1:-1]]


def join_header(parts: list[str]) -> str:
    """Join one column's header lines (a header cell spanning two lines repeats the same text)."""
    out: list[str] = []
    for part in parts:
        if not part or (out and out[-1] == part):
            continue
        out.append(part)
    joined = ""
    for part in out:
        if joined and joined[-1].isascii() and joined[-1].isalnum() and part[0].isascii() and part[0].isalnum():
            joined += " "
        joined += part
    return joined


def model_ids(name: str) -> list[str]:
    """Seed model name -> ids: lowercase, spaces -> '-'; `Llama3.1 -8B/70B` -> two ids."""
    if "/" in name:
        base, sizes = name.rsplit("-", 1)
        names = [f"{base.strip()}-{size.strip()}" for size in sizes.split("/")]
    else:
        names = [name]
    return [re.sub(r"\s+", "-", n.strip()).lower() for n in names]


def parse_seed(text: str) -> dict:
    """{framework: {display_name, headers: [..], rows: {model_id: [raw cells]}, types: {id: type}}}"""
    lines = seed_lines(text)
    seps = [i for i, line in enumerate(lines) if SEPARATOR.fullmatch(line)]
    assert len(seps) == 3, f"expected 3 tables in the seed, found {len(seps)}"
    result: dict = {}
    for sep in seps:
        body = []
        for line in lines[sep + 1:]:
            if line.startswith("| 模型类型") or SEPARATOR.fullmatch(line):
                break
            body.append(line)
        group_cells = split_cells(body[0])
        ncols = len(group_cells)
        groups: list[tuple[str, int, int]] = []        # (name, first column, end column)
        for col, cell in enumerate(group_cells):
            if cell:
                if groups:
                    groups[-1] = (groups[-1][0], groups[-1][1], col)
                groups.append((cell, col, ncols))
        assert groups and group_cells[0], f"no framework group row after the separator: {body[0]!r}"

        first_data = next(i for i, line in enumerate(body) if ROW_START.match(line))
        header_rows = [split_cells(line) for line in body[1:first_data]]
        assert header_rows, "no column header row"
        for row in header_rows:
            assert len(row) == ncols, f"header row has {len(row)} cells, groups span {ncols}: {row}"
        headers = [join_header([row[c] for row in header_rows]) for c in range(ncols)]

        data_rows = body[first_data:]
        for line in data_rows:
            assert ROW_START.match(line), f"unexpected line inside a table: {line!r}"
        for name, start, end in groups:
            framework = FRAMEWORK_OF_GROUP[name]
            assert framework not in result, f"{name} appears twice in the seed"
            rows: dict[str, list[str]] = {}
            types: dict[str, str] = {}
            for line in data_rows:
                cells = split_cells(line)
                assert len(cells) == 3 + ncols, f"row has {len(cells)} cells, expected {3 + ncols}: {line!r}"
                kind = cells[0].strip("*").strip()
                for model in model_ids(cells[2]):
                    assert model not in rows, f"{model} listed twice in the {name} table"
                    rows[model] = cells[3 + start: 3 + end]
                    types[model] = kind
            result[framework] = {"display_name": name, "headers": headers[start:end],
                                 "rows": rows, "types": types}
    return result


def convert(kind: str, raw: str):
    """One seed cell -> the YAML value for a column of that kind."""
    if kind == "flag":
        return FLAGS[raw]
    if raw == "NA":
        return "not_planned"
    if raw == "❌":
        return [] if kind == "list" else "unsupported"
    if raw == "✅":
        raise ValueError(f"a ✅ in a {kind} column has no encoding")
    if kind == "list":
        return [token.strip().lower() for token in re.split(r"[、,，]", raw) if token.strip()]
    return raw.strip().lower()


@pytest.fixture(scope="module")
def seed() -> dict:
    return parse_seed(SEED.read_text(encoding="utf-8"))


def expected_models(seed: dict, framework: str) -> dict:
    kinds = FEATURES[framework]
    rows = seed[framework]["rows"]
    return {model: {key: convert(kind, raw) for (key, kind), raw in zip(kinds, cells, strict=True)}
            for model, cells in rows.items()}


# --------------------------------------------------------------------------- the comparison

def legal(kind: str, value) -> bool:
    if kind == "flag":
        return value in FLAG_VALUES
    if kind == "list":
        return value == "not_planned" or (
            isinstance(value, list) and all(isinstance(v, str) and v in LIST_TOKENS for v in value)
            and len(set(value)) == len(value))
    if not isinstance(value, str):
        return False
    if value in ("unsupported", "not_planned"):
        return True
    if kind == "version":
        return re.fullmatch(r"\d+(\.\d+)+", value) is not None
    if kind == "backend":
        return value != "supported" and re.fullmatch(r"[a-z][a-z0-9_-]*", value) is not None
    raise AssertionError(f"unknown kind {kind}")


def problems(framework: str, doc: dict, seed: dict) -> list[str]:
    """Everything in one framework's loaded YAML that disagrees with the seed (empty = agrees)."""
    out: list[str] = []
    if not isinstance(doc, dict):
        return [f"{framework}: the file is not a mapping"]
    missing = TOP_LEVEL_KEYS - doc.keys()
    if missing:
        out.append(f"{framework}: missing top-level keys {sorted(missing)}")
    if doc.get("framework") != framework:
        out.append(f"{framework}: framework is {doc.get('framework')!r}")
    if doc.get("display_name") != seed[framework]["display_name"]:
        out.append(f"{framework}: display_name {doc.get('display_name')!r}, "
                   f"seed says {seed[framework]['display_name']!r}")
    if doc.get("cell_legend") != CELL_LEGEND:
        out.append(f"{framework}: cell_legend {doc.get('cell_legend')!r}")

    kinds = FEATURES[framework]
    keys = [key for key, _ in kinds]
    features = doc.get("features") or {}
    if list(features) != keys:
        out.append(f"{framework}: feature keys {list(features)}, expected {keys}")
    for (key, _), header in zip(kinds, seed[framework]["headers"]):
        meta = features.get(key)
        if not isinstance(meta, dict):
            out.append(f"{framework}.features.{key}: missing")
            continue
        if not FEATURE_FIELDS <= meta.keys():
            out.append(f"{framework}.features.{key}: needs {sorted(FEATURE_FIELDS)}")
        for field in FEATURE_FIELDS:
            if not isinstance(meta.get(field), str) or not meta.get(field).strip():
                out.append(f"{framework}.features.{key}.{field}: empty or not text")
        if meta.get("seed_header") != header:
            out.append(f"{framework}.features.{key}.seed_header {meta.get('seed_header')!r}, "
                       f"seed column header {header!r}")

    models = doc.get("models") or {}
    expected = expected_models(seed, framework)
    for model in sorted(set(models) - set(expected)):
        out.append(f"{framework}: {model} is not in the seed's {framework} table")
    for model in sorted(set(expected) - set(models)):
        out.append(f"{framework}: the seed lists {model}, the YAML does not")
    for model in sorted(set(models) - set(MODEL_IDS)):
        out.append(f"{framework}: {model} is not a known model id")
    for model, row in models.items():
        if not isinstance(row, dict):
            out.append(f"{framework}.{model}: row is not a mapping")
            continue
        if list(row) != keys:
            out.append(f"{framework}.{model}: keys {list(row)}, expected {keys}")
        for key, kind in kinds:
            if key in row and not legal(kind, row[key]):
                out.append(f"{framework}.{model}.{key}: {row[key]!r} is not a legal {kind} value")
        if model in expected:
            for key, _ in kinds:
                want, got = expected[model][key], row.get(key)
                if got != want or type(got) is not type(want):
                    out.append(f"{framework}.{model}.{key}: YAML {got!r}, seed {want!r}")
    return out


# --------------------------------------------------------------------------- tests

def test_seed_copy_is_verbatim():
    original = ROOT.parent / "shared" / "seeds" / "000_7737d69a6e3a05fa.txt"
    if not original.exists():
        pytest.skip("shared/seeds not present next to this checkout")
    assert SEED.read_bytes() == original.read_bytes()


def test_parser_reads_the_three_tables(seed):
    assert set(seed) == set(FEATURES)
    for framework, kinds in FEATURES.items():
        assert len(seed[framework]["headers"]) == len(kinds), framework
        assert len(seed[framework]["rows"]) == EXPECTED_ROW_COUNTS[framework], framework
        for model, cells in seed[framework]["rows"].items():
            assert len(cells) == len(kinds), (framework, model)
            for (key, kind), raw in zip(kinds, cells):
                assert legal(kind, convert(kind, raw)), (framework, model, key, raw)
    # The MindSpeed-LLM table lists every model, so the id rule must give the contract list.
    assert list(seed["mindspeed-llm"]["rows"]) == MODEL_IDS
    assert seed["mindspeed-llm"]["types"]["gemma3-27b"] == "多模态"
    assert seed["mindspeed-llm"]["types"]["qwen3-32b"] == "LLM"


def test_parser_spot_checks(seed):
    # a few cells read by eye from the seed, so a parser that shifts columns cannot pass
    mm = expected_models(seed, "mindspeed-mm")
    assert mm["qwen2.5-vl-7b"] == dict.fromkeys(
        ["pretrain_full", "sptd", "distributed_optimizer", "recompute"], "supported")
    assert mm["qwen2.5-vl-32b"]["pretrain_full"] == "unsupported"
    lf = expected_models(seed, "llamafactory")
    assert lf["qwen2.5-14b"]["stages"] == ["pt", "sft", "dpo"]
    assert lf["llama3.1-70b"]["stages"] == ["pt", "sft"]
    verl = expected_models(seed, "verl")
    assert verl["qwen3-8b"] == {"methods": ["grpo"], "sglang": "unsupported", "vllm": "0.9.1",
                                "train_backend": "fsdp"}
    assert verl["qwen2.5-1.5b"]["methods"] == []
    rl = expected_models(seed, "mindspeed-rl")
    assert rl["qwen2.5-1.5b"] == {"methods": ["grpo"], "vllm": "0.9.1",
                                  "megatron_backend": "supported", "long_seq": "supported"}
    assert rl["qwen2.5-vl-32b"]["methods"] == "not_planned"
    llm = expected_models(seed, "mindspeed-llm")
    assert llm["deepseek-v2-lite-16b"]["lora"] == "unsupported"
    assert set(llm["qwen2.5-1.5b"].values()) == {"unsupported"}
    assert set(llm["qwen2-vl-2b"].values()) == {"not_planned"}
    assert seed["mindspeed-llm"]["headers"][3] == "Flash Attention"
    assert seed["mindspeed-llm"]["headers"][2] == "多样本pack微调"


@pytest.mark.parametrize("framework", list(FEATURES))
def test_yaml_matches_seed(framework, seed):
    assert problems(framework, load_framework(framework), seed) == []


@pytest.mark.parametrize("framework", list(FEATURES))
def test_comparison_catches_changes(framework, seed):
    """The comparison is not vacuous: any edited, dropped or added cell or row is reported."""
    doc = load_framework(framework)
    model = next(iter(doc["models"]))
    for key, kind in FEATURES[framework]:
        changed = copy.deepcopy(doc)
        value = changed["models"][model][key]
        if kind == "list":
            changed["models"][model][key] = value[:-1] if value and value != "not_planned" else ["sft"]
        elif kind == "version":
            changed["models"][model][key] = "0.9.2" if value != "0.9.2" else "0.9.1"
        else:
            changed["models"][model][key] = "supported" if value != "supported" else "unsupported"
        assert problems(framework, changed, seed), (framework, model, key)
    dropped = copy.deepcopy(doc)
    dropped["models"].pop(model)
    assert problems(framework, dropped, seed)
    added = copy.deepcopy(doc)
    extra = next(m for m in MODEL_IDS if m not in doc["models"]) if len(doc["models"]) < len(MODEL_IDS) else None
    if extra:
        added["models"][extra] = dict(doc["models"][model])
        assert problems(framework, added, seed)
    reordered = copy.deepcopy(doc)
    reordered["features"] = dict(reversed(list(doc["features"].items())))
    assert problems(framework, reordered, seed)


def test_duplicate_keys_are_refused():
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        load_yaml("models:\n  qwen3-8b: {lora: supported}\n  qwen3-8b: {lora: unsupported}\n")
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate key"):
        load_yaml("a: {x: 1, x: 2}\n")


def test_a_changed_seed_is_noticed(seed):
    """Editing the seed text (not the YAML) also breaks the agreement: the parser reads cells."""
    text = SEED.read_text(encoding="utf-8")
    row = "| Qwen3-30B-A3B | ✅ | ❌ |"
    assert row in text
    changed = parse_seed(text.replace(row, "| Qwen3-30B-A3B | ✅ | ✅ |"))
    assert problems("mindspeed-llm", load_framework("mindspeed-llm"), changed)
