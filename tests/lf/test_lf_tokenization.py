"""Our chat templates against LLaMA-Factory 0.9.5: same records, same tiny tokenizers, the same
input_ids and labels (tests/fixtures/llamafactory/lf_0.9.5_reference.json, built by LF's own code
with make_reference.py).

How a case calls our code: resolve_template(name, tok[, enable_thinking=]) +
formats.encode_instruction(..., train_on_prompt=, mask_history=, cutoff_len=) for a conversation,
formats.encode_pairwise(..., cutoff_len=) for a ranking record; the data arguments are the case's.
Every case matches; a fixture case added later that differs needs the code fixed, not an xfail.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from backends.common.data import IGNORE_INDEX, resolve_template
from tests.helpers.lf_encode import encode_record
from tests.helpers.tiny_tokenizers import describe, family_tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "llamafactory" / "lf_0.9.5_reference.json"
REFERENCE = json.loads(FIXTURE.read_text(encoding="utf-8"))


def _cases():
    return REFERENCE["cases"]


def _tokenizer(family: str):
    tok = family_tokenizer(family)
    assert describe(tok) == REFERENCE["tokenizers"][family], (
        f"the tiny {family} tokenizer no longer matches the one the fixture was built with; rerun "
        f"tests/fixtures/llamafactory/make_reference.py")
    return tok


def encode_ours(case: dict) -> dict:
    """Our ids/labels for a case, keyed as LF's processors key them."""
    rec = REFERENCE["records"][case["record"]]
    args = case["data_args"]
    tok = _tokenizer(case["tokenizer"])
    template = resolve_template(case["template"], tok, enable_thinking=args.get("enable_thinking"))
    return encode_record(rec, args, tok, template, Path(FIXTURE.name))


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


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["id"])
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
