"""LLaMA-Factory 0.9.5's template names that tests/lf/test_lf_tokenization.py does not cover (qwen3_nothink,
mistral, deepseek, deepseek3, default, empty, gemma; qwen3 with preserve_thinking), through backends.lf's name
table, against the ids and
labels LF's own code builds (tests/fixtures/upstream/llamafactory/lf_0.9.5_templates.json, written by
make_templates_reference.py next to it); and MindSpeed-LLM's --prompt-type mixtral / deepseek2-lite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.common.data import IGNORE_INDEX, TemplateError, encode_conversation, resolve_template
from backends.lf.data import TEMPLATES as LF_NAMES
from tests.helpers.lf_encode import encode_record
from tests.helpers.tiny_tokenizers import describe
from tests.lf.lf_families import family_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "upstream" / "llamafactory" / "lf_0.9.5_templates.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))
UPSTREAM_NAMES = ROOT.parent / "shared" / "upstream" / "llamafactory-0.9.5-templates.txt"


def tokenizer(family: str):
    tok = family_tokenizer(family)
    assert describe(tok) == REFERENCE["tokenizers"][family], f"rerun {FIXTURE.parent}/make_templates_reference.py"
    return tok


def encode_ours(case: dict, tok) -> dict:
    rec = REFERENCE["records"][case["record"]]
    args = case["data_args"]
    template = resolve_template(LF_NAMES[case["template"]], tok, enable_thinking=args.get("enable_thinking"),
                                preserve_thinking=args.get("preserve_thinking"))
    return encode_record(rec, args, tok, template, FIXTURE)


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: c["id"])
def test_matches_llamafactory(case):
    tok = tokenizer(case["tokenizer"])
    ours = encode_ours(case, tok)
    expected = {k: v for k, v in case["expected"].items() if k not in ("text", "eos_after_fix")}
    if ours != expected:
        key = next(k for k in expected if ours[k] != expected[k])
        show = [x if x == IGNORE_INDEX else tok.convert_ids_to_tokens(x) for x in ours[key]]
        pytest.fail(f"{key}: ours {show}\nLF text {case['expected']['text']!r}")


def test_the_fixture_covers_every_template_named_here():
    """Every LF name backends.lf maps is an LLaMA-Factory 0.9.5 name, and each is held to LF's own output here
    or in test_lf_tokenization.py's fixture."""
    names = set(UPSTREAM_NAMES.read_text().split()) if UPSTREAM_NAMES.exists() else set(LF_NAMES)
    assert set(LF_NAMES) <= names, set(LF_NAMES) - names
    older = json.loads((ROOT / "tests" / "fixtures" / "llamafactory" / "lf_0.9.5_reference.json").read_text())
    covered = {c["template"] for c in REFERENCE["cases"]} | {c["template"] for c in older["cases"]}
    assert set(LF_NAMES) == covered, set(LF_NAMES) ^ covered
    assert any(c["data_args"].get("preserve_thinking") for c in REFERENCE["cases"])
    assert REFERENCE["llamafactory_version"] == "0.9.5"


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"}]


def _ids(tok, *parts):
    """The ids of text parts, each tokenized alone, a token given as ("tok", name) taken as its one id."""
    out = []
    for p in parts:
        out += [tok.convert_tokens_to_ids(p[1])] if isinstance(p, tuple) else tok.encode(p, add_special_tokens=False)
    return out


@pytest.mark.parametrize("prompt_type,family,expect", [
    # MindSpeed-LLM configs/finetune/templates.json: mixtral = its mistral, system as a plain prefix element
    # is MindSpeed-LLM's; the registry's puts it into the first [INST] (Mistral's convention), so no system here
    ("mixtral", "mistral", lambda: [("tok", "<s>"), ("tok", "[INST]"), " Hi ", ("tok", "[/INST]"), "Hello",
                                    ("tok", "</s>"), ("tok", "[INST]"), " Bye ", ("tok", "[/INST]"), "Ciao",
                                    ("tok", "</s>")]),
    ("deepseek2-lite", "deepseek", lambda: [("tok", "<｜begin▁of▁sentence｜>"), "Be brief.\n\n",
                                            "User: Hi\n\nAssistant:", "Hello", ("tok", "<｜end▁of▁sentence｜>"),
                                            "User: Bye\n\nAssistant:", "Ciao", ("tok", "<｜end▁of▁sentence｜>")]),
])
def test_mindspeed_llm_prompt_types(prompt_type, family, expect):
    from backends.contract.prompts import PROMPT_TYPE_TEMPLATES, TEMPLATE_PROMPT_TYPES

    tok = family_tokenizer(family)
    template = resolve_template(PROMPT_TYPE_TEMPLATES[prompt_type], tok)
    conv = CONV if prompt_type != "mixtral" else CONV[1:]
    enc = encode_conversation(tok, template, conv)
    assert enc.input_ids == _ids(tok, *expect())
    answers = [i for i, label in zip(enc.input_ids, enc.labels) if label != IGNORE_INDEX]
    eos = tok.eos_token_id
    assert answers == _ids(tok, "Hello") + [eos] + _ids(tok, "Ciao") + [eos]
    assert TEMPLATE_PROMPT_TYPES[prompt_type] == prompt_type
    assert TEMPLATE_PROMPT_TYPES["mistral"] == "mistral" and TEMPLATE_PROMPT_TYPES["deepseek"] == "deepseek3"
    # MindSpeed-LLM's own `default` is not LF's: the LF one is registered under another name, so
    # --prompt-type default finds no template rather than the wrong one
    from backends.common.data import TEMPLATES

    assert PROMPT_TYPE_TEMPLATES.get("default", "default") not in TEMPLATES


def test_tokenizer_slots_follow_the_tokenizer():
    """`default` ends turns with the tokenizer's own EOS; a template needing an EOS the tokenizer lacks is
    refused by name; LF's BOS slot gives nothing without a BOS."""
    for family in ("mistral", "qwen"):
        tok = family_tokenizer(family)
        text = resolve_template("lf_default", tok).render(CONV[1:3])
        assert text == f"Human: Hi{tok.eos_token}\nAssistant:Hello{tok.eos_token}\n"
    tok = family_tokenizer("qwen")
    assert resolve_template("deepseek2", tok).render(CONV[1:3]) == "User: Hi\n\nAssistant:Hello<|im_end|>"
    tok.eos_token = None
    with pytest.raises(TemplateError, match="'lf_default' ends turns with the tokenizer's EOS"):
        resolve_template("lf_default", tok)
    from backends.common.data import TEMPLATES

    with pytest.raises(TemplateError, match="resolve_template"):
        TEMPLATES["lf_default"].render(CONV[1:3])


def test_the_training_files_thinking_keys_reach_the_template(tmp_path):
    from backends.lf.data import build_template
    from backends.lf.recipe import parse_command
    from tests.helpers.lf_runs import lf_file

    path = lf_file(tmp_path, template="qwen3")
    template = build_template(parse_command(["train", str(path), "preserve_thinking=true", "enable_thinking=false"]),
                              family_tokenizer("qwen3"))
    assert (template.preserve_thinking, template.enable_thinking) == (True, False)
    assert build_template(parse_command(["train", str(path)]), family_tokenizer("qwen3")).preserve_thinking is False
