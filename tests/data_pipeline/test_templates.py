"""Chat templates: exact renders, vocab checks, and which tokens each template trains."""

import pytest

from backends.common.data import TEMPLATES, JinjaTemplate, TemplateError, encode_conversation, resolve_template
from backends.common.data.templates import IGNORE_INDEX, ChatTemplate

CONV = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao"},
]

# what each family's published chat template renders for CONV (see templates.py for the sources)
EXPECTED = {
    "qwen": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
             "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nCiao<|im_end|>\n"),
    "qwen3": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
              "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nCiao<|im_end|>\n"),
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nCiao<|eot_id|>"),
    "glm4": "[gMASK]<sop><|system|>\nS<|user|>\nHi<|assistant|>\nHello<|user|>\nBye<|assistant|>\nCiao",
    "mistral": "<s>[INST] S\n\nHi [/INST]Hello</s>[INST] Bye [/INST]Ciao</s>",
    "deepseek": ("<｜begin▁of▁sentence｜>S<｜User｜>Hi<｜Assistant｜>Hello<｜end▁of▁sentence｜>"
                 "<｜User｜>Bye<｜Assistant｜>Ciao<｜end▁of▁sentence｜>"),
    "qwen2_vl": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
                 "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nCiao<|im_end|>\n"),
    "gemma3": ("<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
               "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\nCiao<end_of_turn>\n"),
    "qwen3_nothink": ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello"
                      "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\nCiao<|im_end|>\n"),
    "empty": "SHiHelloByeCiao",
}
# templates whose BOS / EOS are the tokenizer's (LF's bos_token / eos_token slots): rendered once bound to a
# tokenizer; tests/lf/test_lf_templates.py holds them against LLaMA-Factory's own ids
TOKENIZER_BOUND = {"deepseek2", "mistral_v3", "lf_default"}
GENERATION_PROMPT = {"qwen": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                     "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "glm4": "<|assistant|>",
                     "mistral": "[INST] Bye [/INST]", "deepseek": "<｜Assistant｜>",
                     "qwen2_vl": "<|im_start|>assistant\n", "gemma3": "<start_of_turn>model\n",
                     "qwen3_nothink": "<|im_start|>assistant\n", "empty": "Bye"}
TRAINED = {
    "qwen": ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"],
    "qwen3": ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"],
    "llama3": ["Hello<|eot_id|>", "Ciao<|eot_id|>"],
    "glm4": ["\nHello<|endoftext|>", "\nCiao<|endoftext|>"],   # the EOS label sits on the next '<|user|>'
    "mistral": ["Hello</s>", "Ciao</s>"],
    "deepseek": ["Hello<｜end▁of▁sentence｜>", "Ciao<｜end▁of▁sentence｜>"],
    "qwen2_vl": ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"],
    "gemma3": ["Hello<end_of_turn>\n", "Ciao<end_of_turn>\n"],
    "qwen3_nothink": ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"],
    "empty": ["Hello", "Ciao"],
}


def trained_runs(tok, ids, labels):
    """The trained label runs, decoded. A label differs from its token only where an efficient-EOS template
    (glm4) labels the next user turn's first token with the EOS the answer ends on."""
    runs, cur = [], []
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    for i, lab in zip(ids, labels):
        if lab == IGNORE_INDEX:
            if cur:
                runs.append(cur)
            cur = []
        else:
            assert lab == i or lab == eos
            cur.append(lab)
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def tokenizer_for(make_tokenizer, name):
    return make_tokenizer(TEMPLATES[name].required_tokens)


def test_all_named_templates_exist():
    assert set(TEMPLATES) == set(EXPECTED) | TOKENIZER_BOUND


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_template_renders_known_conversation(name):
    t = TEMPLATES[name]
    assert t.render(CONV) == EXPECTED[name]
    assert t.render(CONV[:4], add_generation_prompt=True).endswith(GENERATION_PROMPT[name])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_template_trains_every_assistant_turn(make_tokenizer, name):
    tok = tokenizer_for(make_tokenizer, name)
    template = resolve_template(name, tok)
    enc = encode_conversation(tok, template, CONV)
    assert trained_runs(tok, enc.input_ids, enc.labels) == TRAINED[name]
    assert tok.decode(enc.input_ids, skip_special_tokens=False) == EXPECTED[name] + template.train_suffix
    # every special token of the template is one id in the encoding
    for special in template.required_tokens:
        assert tok.convert_tokens_to_ids(special) in enc.input_ids or special not in EXPECTED[name]


def test_qwen_default_system_and_llama3_keeps_contents_verbatim():
    default = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    assert TEMPLATES["qwen"].render(CONV[1:3]).startswith(default)
    assert TEMPLATES["qwen3"].render(CONV[1:3]).startswith("<|im_start|>user\nHi")
    conv = [{"role": "user", "content": "  Hi \n"}, {"role": "assistant", "content": " Hello "}]
    assert TEMPLATES["llama3"].render(conv).endswith("\n\n  Hi \n<|eot_id|><|start_header_id|>assistant"
                                                     "<|end_header_id|>\n\n Hello <|eot_id|>")


def test_named_qwen_matches_the_tiny_models_own_chatml(tiny_tok):
    own = resolve_template(None, tiny_tok)
    assert isinstance(own, JinjaTemplate)
    assert own.render(CONV) == TEMPLATES["qwen"].render(CONV)
    assert own.render(CONV[:2], add_generation_prompt=True) == TEMPLATES["qwen"].render(CONV[:2], True)


def test_named_template_with_missing_special_tokens_names_them(tiny_tok):
    with pytest.raises(TemplateError) as err:
        resolve_template("llama3", tiny_tok)
    msg = str(err.value)
    for token in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert token in msg
    assert "llama3" in msg
    assert resolve_template("qwen", tiny_tok) is TEMPLATES["qwen"]


def test_qwen3_without_thinking_tokens_encodes_the_block_as_text(tiny_tok):
    # as LLaMA-Factory: the ChatML markers are needed, <think> / </think> may be plain text
    assert tiny_tok.convert_tokens_to_ids("<think>") == tiny_tok.unk_token_id
    template = resolve_template("qwen3", tiny_tok, enable_thinking=True)
    enc = encode_conversation(tiny_tok, template, CONV)
    block = tiny_tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert len(block) > 2
    assert trained_runs(tiny_tok, enc.input_ids, enc.labels) == [
        "<think>\n\n</think>\n\nHello<|im_end|>\n", "<think>\n\n</think>\n\nCiao<|im_end|>\n"]
    assert enc.turns[0].target[:len(block)] == block


THOUGHTS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]


@pytest.mark.parametrize("thinking, trained, masked_blocks", [
    # unset (MindSpeed-LLM's default): an answer's own thinking is kept, trained; one without gets the block masked
    (None, ["<think>\nhm\n</think>\n\nHello<|im_end|>\n", "Ciao<|im_end|>\n"], 1),
    (True, ["<think>\nhm\n</think>\n\nHello<|im_end|>\n", "<think>\n\n</think>\n\nCiao<|im_end|>\n"], 0),
    (False, ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"], 2),     # thinking stripped, both blocks masked
])
def test_qwen3_enable_thinking(make_tokenizer, thinking, trained, masked_blocks):
    tok = make_tokenizer(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    template = resolve_template("qwen3", tok, enable_thinking=thinking)
    enc = encode_conversation(tok, template, THOUGHTS)
    assert trained_runs(tok, enc.input_ids, enc.labels) == trained
    think = tok.convert_tokens_to_ids("<think>")
    assert sum(1 for i, lab in zip(enc.input_ids, enc.labels) if i == think and lab == IGNORE_INDEX) == masked_blocks
    gen = template.render(THOUGHTS[:1], add_generation_prompt=True)
    assert gen.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))


def test_unknown_template_and_base_tokenizer_without_template(make_tokenizer):
    base = make_tokenizer(["<|endoftext|>"])
    with pytest.raises(TemplateError, match="no chat_template.*qwen, qwen3, llama3, glm4, mistral, deepseek"):
        resolve_template(None, base)
    with pytest.raises(TemplateError, match="unknown chat template 'vicuna'"):
        resolve_template("vicuna", base)


# A template in the manner of Qwen3's own: the empty thinking block only on assistant turns after
# the last user message, so rendering a longer conversation rewrites the earlier turns.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def test_history_rewriting_template_uses_sentinels(make_tokenizer):
    tok = make_tokenizer(["<|im_start|>", "<|im_end|>", "<think>", "</think>"], chat_template=QWEN3_LIKE)
    template = resolve_template(None, tok)
    enc = encode_conversation(tok, template, CONV)
    assert enc.method.startswith("sentinel")
    full = template.render(CONV)
    assert full.count("<think>") == 1              # only the last turn carries the thinking block
    assert tok.decode(enc.input_ids, skip_special_tokens=False) == full
    assert trained_runs(tok, enc.input_ids, enc.labels) == ["Hello<|im_end|>\n", "Ciao<|im_end|>\n"]


class CutWordTemplate(ChatTemplate):
    """The generation prompt ends inside a word, so BPE merges across the prompt/answer boundary."""

    name = "cut"

    def render(self, messages, add_generation_prompt=False):
        out = ""
        for m in messages:
            out += ("Q " + m["content"] + " The ans") if m["role"] == "user" else m["content"] + "\n"
        return out

    def fingerprint(self):
        return "cut"


def test_token_boundary_crossing_falls_back_to_segments(make_tokenizer):
    tok = make_tokenizer(["<|endoftext|>"])
    conv = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "wer is 4."}]
    enc = encode_conversation(tok, CutWordTemplate(), conv)
    assert enc.method == "segmented"
    prompt = tok.encode("Q What is 2 + 2? The ans", add_special_tokens=False)
    answer = tok.encode("wer is 4.\n", add_special_tokens=False)
    assert enc.input_ids == prompt + answer
    assert enc.labels == [IGNORE_INDEX] * len(prompt) + answer
    # whereas the canonical tokenization of the whole text merges across the boundary
    assert tok.encode("Q What is 2 + 2? The answer is 4.\n", add_special_tokens=False)[:len(prompt)] != prompt


def test_canonical_tokenization_is_kept_when_boundaries_hold(tiny_tok):
    template = resolve_template(None, tiny_tok)
    enc = encode_conversation(tiny_tok, template, CONV)
    assert enc.method == "prefix"
    assert enc.input_ids == tiny_tok.encode(template.render(CONV), add_special_tokens=False)


@pytest.mark.parametrize("bad, msg", [
    ([], "empty conversation"),
    ([{"role": "user", "content": "a"}], "ends with a user message"),
    ([{"role": "assistant", "content": "a"}], "expected 'user'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "expected 'assistant'"),
])
def test_malformed_conversations(tiny_tok, bad, msg):
    with pytest.raises(TemplateError, match=msg):
        encode_conversation(tiny_tok, TEMPLATES["qwen"], bad)
