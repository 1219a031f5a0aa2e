"""Our chat templates against LLaMA-Factory 0.9.5: same records, same tiny tokenizers, the same
input_ids and labels (tests/fixtures/llamafactory/lf_0.9.5_reference.json, built by LF's own code
with make_reference.py).

How a case calls our code: resolve_template(name, tok[, enable_thinking=]) +
formats.encode_instruction(...[, train_on_prompt=, mask_history=, cutoff_len=]), else
formats.truncate at cutoff_len. An option the signature has is always passed; one it lacks is passed
only when the case turns it on (so today's code raises TypeError there), so each xfail below turns
into a pass, and strict=True makes it fail, once the option is built and matches LF. Pairwise records go
through formats.encode_pairwise when it exists, else each of prompt+chosen / prompt+rejected is
encoded as a conversation.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import pytest

from backends.common.data import IGNORE_INDEX, formats, resolve_template
from tests.helpers.tiny_tokenizers import describe, family_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llamafactory" / "lf_0.9.5_reference.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))

def _known_difference(case: dict) -> str | None:
    """Why a case differs from LF today (None: it matches). Each reason is an xfail(strict): a case that
    starts to match without this table being updated fails, as does one that breaks. Every case matches
    now; a new fixture case that differs names its LF rule here."""
    return None


def _cases():
    return REFERENCE["cases"]


def _params():
    out = []
    for case in _cases():
        reason = _known_difference(case)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(case, id=case["id"], marks=marks))
    return out


def _tokenizer(family: str):
    tok = family_tokenizer(family)
    assert describe(tok) == REFERENCE["tokenizers"][family], (
        f"the tiny {family} tokenizer no longer matches the one the fixture was built with; rerun "
        f"tests/fixtures/llamafactory/make_reference.py")
    return tok


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _options(fn, wanted: dict) -> dict:
    """The options fn takes; one it lacks is still passed when set (a TypeError: not built yet)."""
    return {k: v for k, v in wanted.items() if _accepts(fn, k) or v}


def encode_ours(case: dict) -> dict:
    """Our ids/labels for a case, keyed as LF's processors key them."""
    rec = REFERENCE["records"][case["record"]]
    args = case["data_args"]
    tok = _tokenizer(case["tokenizer"])
    thinking = {"enable_thinking": args["enable_thinking"]} if "enable_thinking" in args else {}
    template = resolve_template(case["template"], tok, **_options(resolve_template, thinking))
    cutoff = args["cutoff_len"]
    opts = _options(formats.encode_instruction, {k: bool(args.get(k)) for k in ("train_on_prompt", "mask_history")})
    where = Path(FIXTURE.name)
    if rec["ranking"]:
        record = rec["record"]
        if hasattr(formats, "encode_pairwise"):
            chosen, rejected = formats.encode_pairwise(tok, template, record, where, 0, cutoff_len=cutoff)
        else:
            base = {k: v for k, v in record.items() if k not in ("chosen", "rejected")}
            chosen, rejected = (formats.truncate(formats.encode_instruction(
                tok, template, "alpaca", {**base, "output": record[k]}, where, 0), cutoff)[0]
                for k in ("chosen", "rejected"))
        return {"chosen_input_ids": chosen.input_ids, "chosen_labels": chosen.labels,
                "rejected_input_ids": rejected.input_ids, "rejected_labels": rejected.labels}
    if _accepts(formats.encode_instruction, "cutoff_len"):
        opts["cutoff_len"] = cutoff
    sample = formats.encode_instruction(tok, template, rec["formatting"], rec["record"], where, 0, **opts)
    if "cutoff_len" not in opts:
        sample, _ = formats.truncate(sample, cutoff)
    return {"input_ids": sample.input_ids, "labels": sample.labels}


def describe_difference(tok, ours: dict, expected: dict) -> str:
    """First differing position of each sequence, with the tokens around it."""
    lines = []
    for key, want in expected.items():
        if key in ("text", "eos_after_fix"):
            continue
        got = ours[key]
        if got == want:
            continue
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))

        def show(seq):
            return [x if x == IGNORE_INDEX else tok.convert_ids_to_tokens(x) for x in seq[max(0, at - 2):at + 4]]
        lines.append(f"{key}: len ours {len(got)} LF {len(want)}; first difference at {at}: "
                     f"ours {show(got)} LF {show(want)}")
    return "; ".join(lines)


@pytest.mark.parametrize("case", _params())
def test_matches_llamafactory(case):
    expected = case["expected"]
    if "error" in expected:
        # LF refuses this combination; so must we
        with pytest.raises(ValueError, match="train_on_prompt"):
            encode_ours(case)
        return
    ours = encode_ours(case)
    tok = _tokenizer(case["tokenizer"])
    diff = describe_difference(tok, ours, expected)
    assert not diff, diff


def test_fixture_is_llamafactory_0_9_5():
    assert REFERENCE["llamafactory_version"] == "0.9.5"
    assert "make_reference.py" in REFERENCE["_header"]
    templates = {c["template"] for c in _cases()}
    assert templates >= {"qwen", "qwen3", "llama3", "glm4", "qwen2_vl", "gemma3"}


@pytest.mark.upstream
@pytest.mark.skipif(importlib.util.find_spec("llamafactory") is None, reason="llamafactory is not installed")
def test_reference_regenerates_from_llamafactory():
    """With llamafactory installed, its own code rebuilds exactly the stored fixture."""
    import sys

    sys.path.insert(0, str(FIXTURE.parent))
    try:
        import make_reference
    finally:
        sys.path.remove(str(FIXTURE.parent))
    live = make_reference.build(None)
    if live["llamafactory_version"] != REFERENCE["llamafactory_version"]:
        pytest.skip(f"installed llamafactory is {live['llamafactory_version']}, the fixture is for 0.9.5")
    assert live["tokenizers"] == REFERENCE["tokenizers"]
    stored = {c["id"]: c for c in _cases()}
    for case in live["cases"]:
        assert case == stored[case["id"]], f"{case['id']}: LLaMA-Factory builds different ids/labels now"
    assert len(live["cases"]) == len(stored)
