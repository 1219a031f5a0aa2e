"""backends.rl.rollout: the KV-cache generator against transformers' generate, its sampler against
transformers' logits warpers and the model's own probabilities, stop rules, and the engine check."""

from pathlib import Path

import pytest
import torch

from backends import kernels
from backends.rl import rollout
from backends.rl.rollout import generate

ROOT = Path(__file__).resolve().parents[2]
TINY_QWEN3 = ROOT / "examples" / "tiny-qwen3"
TEXTS = ["What is 3 + 4?", "Hello", "What is 96 * 12? Put the final answer after ####.", "12"]


@pytest.fixture(scope="module")
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(TINY_QWEN3)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def pair(request, tmp_path_factory):
    """(native model, transformers model) of the bundled tiny Qwen3 and a tiny Qwen2 (q/k/v biases)."""
    import transformers

    from backends.models.decoder import from_pretrained

    if request.param == "qwen3":
        path = TINY_QWEN3
    else:
        from tests.helpers.tiny_hf import make_tiny_hf

        path = make_tiny_hf("qwen2", tmp_path_factory.mktemp("qwen2"), seed=3)
    return from_pretrained(path), transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _hf_greedy(hf, prompt, max_new_tokens, eos=None, **kw):
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                      pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_token_for_token(pair, prompts):
    ours_model, hf = pair
    ours = generate(ours_model, prompts, max_new_tokens=24, temperature=0)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(hf, prompt, 24)
    # EOS: pick a token greedy emits mid-way in prompt 0's answer; both stop right after it (kept)
    eos = ours[0][5]
    stopped = generate(ours_model, prompts, max_new_tokens=24, temperature=0, eos_token_id=[eos, 511])
    for prompt, got, full in zip(prompts, stopped, ours):
        want = _hf_greedy(hf, prompt, 24, eos=[eos, 511])
        assert got == want
        assert got == (full[:full.index(eos) + 1] if eos in full else full)
    assert len(stopped[0]) <= 6


def test_prefill_reads_each_prompt_once(pair, prompts):
    """One packed prefill of the distinct prompts (no padding, not n copies), then one [rows, 1] decode
    per step; each prompt's n greedy samples all continue its own prefill."""
    model = pair[0]
    shapes = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(args[0].shape)),
                                           with_kwargs=True)
    try:
        four = generate(model, prompts, max_new_tokens=3, temperature=0, n=4)
    finally:
        hook.remove()
    assert shapes == [(1, sum(map(len, prompts)))] + [(4 * len(prompts), 1)] * 2
    one = generate(model, prompts, max_new_tokens=3, temperature=0)
    assert four == [x for x in one for _ in range(4)]


def test_generation_leaves_the_model_as_it_was(pair, prompts):
    model = pair[0]
    ids = torch.tensor([prompts[2]])
    before = model(ids)
    model.train()
    generate(model, prompts, max_new_tokens=3, temperature=0)
    assert model.training
    assert all("core_attention" in layer.self_attn.__dict__ and not isinstance(
        layer.self_attn.core_attention, rollout._CachedCore) for layer in model.model.layers)
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)


def test_stop_strings_match_transformers(pair, prompts, tokenizer):
    model, hf = pair
    full = generate(model, prompts[:1], max_new_tokens=24, temperature=0)[0]
    pieces = [tokenizer.decode([t]) for t in full]
    clean = [i for i in range(1, 20) if all(p.isascii() and p.strip() and len(p) >= 2 for p in pieces[i - 1:i + 1])]
    assert clean, pieces
    j = clean[0]
    stop = pieces[j - 1][-1] + pieces[j][:2]  # spans two tokens and ends inside token j
    got = generate(model, prompts[:1], max_new_tokens=24, temperature=0, stop=[stop],
                   decode=lambda ids: tokenizer.decode(ids))[0]
    assert got == _hf_greedy(hf, prompts[0], 24, stop_strings=[stop], tokenizer=tokenizer)
    assert got == full[:j + 1]
    with pytest.raises(ValueError, match="decode"):
        generate(model, prompts, max_new_tokens=4, stop=["x"])


def test_filter_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.3, 5, 1.0), (1.0, 10, 0.5), (0.5, 3, 0.95)]:
        want = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1:
            want = TopPLogitsWarper(top_p)(None, want)
        got = rollout.filter_logits(logits, temperature, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_samples_follow_the_model_distribution(pair, prompts):
    """First tokens of 3000 samples (temperature 0.8, top-k 4) against the model's filtered softmax."""
    model = pair[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[1]]))[0, -1].float()
    probs = rollout.filter_logits(logits[None], 0.8, 4, 1.0).softmax(-1)[0]
    n = 3000
    first = [s[0] for s in generate(model, [prompts[1]], max_new_tokens=1, temperature=0.8, top_k=4, n=n, seed=5)]
    counts = torch.bincount(torch.tensor(first), minlength=probs.numel()).double() / n
    assert set(first) <= set(torch.nonzero(probs).flatten().tolist())  # never outside the top 4
    assert (counts - probs.double()).abs().max() < 4 * (0.25 / n) ** 0.5  # 4 standard errors at worst


def test_draw_follows_the_probabilities():
    """The sampler itself on a peaked distribution with zero-probability tokens between the others."""
    probs = torch.tensor([0.0, 0.6, 0.0, 0.25, 0.1, 0.0, 0.05])
    n = 4000
    streams = [torch.Generator().manual_seed(i) for i in range(n)]
    got = rollout.draw(probs.expand(n, -1), streams)
    counts = torch.bincount(torch.tensor(got), minlength=probs.numel()).double() / n
    assert counts[probs == 0].sum() == 0
    assert (counts - probs.double()).abs().max() < 4 * (0.25 / n) ** 0.5
    assert rollout.draw(probs.expand(3, -1), [torch.Generator().manual_seed(1)] * 3)[0] == \
        rollout.draw(probs[None], [torch.Generator().manual_seed(1)])[0]  # a row's draw is its stream's


def test_sampling_is_seeded_per_sample(pair, prompts):
    model = pair[0]
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, n=3, seed=7)
    a = generate(model, prompts, **kw)
    assert a == generate(model, prompts, **kw)
    assert a != generate(model, prompts, **{**kw, "seed": 8})
    assert len(a) == 12 and a[0] != a[1]  # n samples per prompt, in prompt order, not copies
    # a prompt's samples do not depend on its batch: alone (with its global id) they are the same
    assert generate(model, [prompts[2]], prompt_ids=[2], **kw) == a[6:9]
    twice = generate(model, [prompts[1], prompts[1]], **kw)  # the same prompt twice: two prompts' streams
    assert twice[:3] != twice[3:]
    # top-k 1 is greedy
    assert generate(model, prompts, max_new_tokens=8, top_k=1, seed=3) == \
        generate(model, prompts, max_new_tokens=8, temperature=0)


def test_cache_attention_against_per_row_attention():
    torch.manual_seed(0)
    b, skv, sq, h, hkv, d = 3, 9, 2, 4, 2, 8
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, skv, hkv, d), torch.randn(b, skv, hkv, d)
    lengths = torch.tensor([9, 4, 2])
    out = kernels.cache_attention(q, k, v, lengths, scale=0.3)
    for row, n in enumerate(lengths.tolist()):  # row's real keys, causal and bottom-right aligned
        want = kernels.attention(q[row:row + 1], k[row:row + 1, :n], v[row:row + 1, :n], causal=True, scale=0.3)
        torch.testing.assert_close(out[row], want[0])


def test_engine_check():
    assert rollout.check_engine("hf") == "hf"
    with pytest.raises(ValueError, match="not one of"):
        rollout.check_engine("sglang-ish")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"vllm is not installed.*\[vllm\].*rl.rollout.engine: hf"):
            rollout.check_engine("vllm")
    else:
        assert rollout.check_engine("vllm") == "vllm"
