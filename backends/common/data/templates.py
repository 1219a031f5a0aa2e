"""Chat templates and the assistant-only label mask.

Which template formats a conversation
-------------------------------------
`resolve_template(None, tok)` uses the tokenizer's own Jinja `chat_template` (what the model was
post-trained with; rendered through `tokenizer.apply_chat_template(..., enable_thinking=False)`,
the switch Qwen3 reads and other templates ignore). A base model without one needs a named
template; each below renders what the family's published chat template / LLaMA-Factory's template
of the same name produces, for the plain system/user/assistant subset (no tools):

  qwen     ChatML as LLaMA-Factory `qwen` (Qwen2.5-Instruct's own default): default system prompt
           "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
           <|im_start|>{role}\\n{content}<|im_end|>\\n
  qwen3    ChatML with no default system; every assistant turn opens with the empty thinking block
           "<think>\\n\\n</think>\\n\\n" (as LLaMA-Factory's `qwen3` with enable_thinking=False, which
           puts it in the prompt, untrained). Qwen3's own Jinja writes that block only on the turns
           after the last user message; pass template=None to get exactly that for a Qwen3 tokenizer.
  llama3   Llama-3-Instruct: <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n
           {content}<|eot_id|> (no default system; Llama 3.1's date preamble is not added). Contents
           are kept verbatim as LLaMA-Factory does (Meta's Jinja trims them; data written for it
           should be trimmed beforehand).
  glm4     GLM-4-9B-Chat: [gMASK]<sop><|system|>\\n{s}<|user|>\\n{u}<|assistant|>\\n{a}; the turn has
           no end marker (generation stops at the next <|user|>), so, as GLM-4's fine-tuning code
           and LLaMA-Factory (efficient_eos), the EOS <|endoftext|> closes the conversation, trained.
  mistral  Mistral-7B/Mixtral-8x7B-Instruct-v0.1 and LLaMA-Factory `mistral`:
           <s>[INST] {u} [/INST]{a}</s>; a system prompt goes before the first user message as
           "{system}\\n\\n{user}" (Mistral's later templates' convention; v0.1 has no system role).
  deepseek DeepSeek-V3 / R1: <｜begin▁of▁sentence｜>{system}<｜User｜>{u}<｜Assistant｜>{a}
           <｜end▁of▁sentence｜> (no default system; the system text follows BOS unmarked)

A named template whose special tokens do not encode as single tokens of the tokenizer raises
`TemplateError` naming them (a Llama 3 template on a Qwen tokenizer fails at once, not silently).

How the label boundaries are guaranteed (encode_conversation)
-------------------------------------------------------------
For every assistant message i the template renders the prefix P_i = messages[:i] with the
generation prompt and F_i = messages[:i+1]. The pieces P_i - F_{i-1} (prompt, masked) and
F_i - P_i (the answer and its end-of-turn marker, trained) tile the full render exactly when every
render is a string prefix of the next; that is checked. The text is then tokenized once and every
piece boundary is checked to be a token boundary: the ids of each prefix text must be a prefix of
the ids of the whole ("token prefix property"). When it holds, the canonical tokenization is kept
and each label range is exact. When a BPE merge crosses a boundary, the pieces are tokenized one by
one and concatenated (LLaMA-Factory's way), so boundaries are exact by construction
(`Encoded.method == "segmented"`).
Templates that rewrite earlier turns (Qwen3's own drops the thinking block from older turns, so
F_1 is not a prefix of P_2) are handled by rendering the whole conversation once with each assistant
content replaced by a unique sentinel: the sentinels place every answer in the real render, each
answer span is F_i - P_i found at its sentinel, and the render with the real contents must equal
the plain render (`method == "sentinel"`); if not, a `TemplateError` says so.
Every assistant turn is trained; system, user and template text is -100.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant")


class TemplateError(ValueError):
    """A template that does not fit the tokenizer or cannot be used for label masking."""


class ChatTemplate:
    """render(messages, add_generation_prompt) -> str; `name`; `train_suffix`: text appended after the
    whole conversation and trained (efficient-EOS templates: glm4)."""

    train_suffix = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class JinjaTemplate(ChatTemplate):
    """The tokenizer's own chat_template."""

    def __init__(self, tokenizer, **template_kwargs):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.name = "tokenizer"
        self.source = str(tokenizer.chat_template)
        self.template_kwargs = {"enable_thinking": False, **template_kwargs}

    def render(self, messages, add_generation_prompt=False):
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def fingerprint(self):
        text = self.source + repr(sorted(self.template_kwargs.items()))
        return "jinja:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class NamedTemplate(ChatTemplate):
    """A fixed-string template: prefix, system/user formats, assistant header and end of turn."""

    name: str
    prefix: str
    system_fmt: str          # "{content}" placeholder; "" when system goes into the first user turn
    user_fmt: str
    assistant_header: str    # the generation prompt
    assistant_fmt: str       # rendered after the header; trained (with the end of turn)
    required_tokens: tuple[str, ...]
    default_system: str = ""
    system_in_first_user: str = ""   # e.g. "{system}\n\n{content}" (mistral)
    train_suffix: str = ""
    reference: str = ""

    def render(self, messages, add_generation_prompt=False):
        msgs = list(messages)
        system = self.default_system
        if msgs and msgs[0]["role"] == "system":
            system = msgs[0]["content"]
            msgs = msgs[1:]
        out = self.prefix
        if system and not self.system_in_first_user:
            out += self.system_fmt.format(content=system)
        first_user = True
        for m in msgs:
            content = m["content"]
            if m["role"] == "user":
                if first_user and system and self.system_in_first_user:
                    content = self.system_in_first_user.format(system=system, content=content)
                out += self.user_fmt.format(content=content)
                first_user = False
            elif m["role"] == "assistant":
                out += self.assistant_header + self.assistant_fmt.format(content=content)
            else:
                raise TemplateError(f"template {self.name!r}: a system message may only come first")
        if add_generation_prompt:
            out += self.assistant_header
        return out

    def fingerprint(self):
        return "named:" + hashlib.sha256(repr(self).encode()).hexdigest()

    def __repr__(self):  # dataclass repr includes every field: a stable definition hash
        fields = (self.name, self.prefix, self.system_fmt, self.user_fmt, self.assistant_header, self.assistant_fmt,
                  self.required_tokens, self.default_system, self.system_in_first_user, self.train_suffix)
        return f"NamedTemplate{fields!r}"


_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
TEMPLATES: dict[str, NamedTemplate] = {
    t.name: t for t in (
        NamedTemplate(
            name="qwen", prefix="",
            system_fmt="<|im_start|>system\n{content}<|im_end|>\n",
            user_fmt="<|im_start|>user\n{content}<|im_end|>\n",
            assistant_header="<|im_start|>assistant\n", assistant_fmt="{content}<|im_end|>\n",
            default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
            required_tokens=_CHATML_TOKENS,
            reference="Qwen2.5-Instruct chat_template; LLaMA-Factory template 'qwen'"),
        NamedTemplate(
            name="qwen3", prefix="",
            system_fmt="<|im_start|>system\n{content}<|im_end|>\n",
            user_fmt="<|im_start|>user\n{content}<|im_end|>\n",
            assistant_header="<|im_start|>assistant\n<think>\n\n</think>\n\n", assistant_fmt="{content}<|im_end|>\n",
            required_tokens=_CHATML_TOKENS + ("<think>", "</think>"),
            reference="Qwen3 chat_template with enable_thinking=False; LLaMA-Factory template 'qwen3'"),
        NamedTemplate(
            name="llama3", prefix="<|begin_of_text|>",
            system_fmt="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
            user_fmt="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
            assistant_header="<|start_header_id|>assistant<|end_header_id|>\n\n", assistant_fmt="{content}<|eot_id|>",
            required_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            reference="Meta-Llama-3-8B-Instruct chat_template; LLaMA-Factory template 'llama3'"),
        NamedTemplate(
            name="glm4", prefix="[gMASK]<sop>",
            system_fmt="<|system|>\n{content}", user_fmt="<|user|>\n{content}",
            assistant_header="<|assistant|>", assistant_fmt="\n{content}", train_suffix="<|endoftext|>",
            required_tokens=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>"),
            reference="glm-4-9b-chat chat_template; LLaMA-Factory template 'glm4' (efficient_eos)"),
        NamedTemplate(
            name="mistral", prefix="<s>", system_fmt="",
            user_fmt="[INST] {content} [/INST]", assistant_header="", assistant_fmt="{content}</s>",
            system_in_first_user="{system}\n\n{content}", required_tokens=("<s>", "</s>"),
            reference="Mistral-7B-Instruct-v0.1 / Mixtral-8x7B-Instruct-v0.1; LLaMA-Factory template 'mistral'"),
        NamedTemplate(
            name="deepseek", prefix="<｜begin▁of▁sentence｜>", system_fmt="{content}",
            user_fmt="<｜User｜>{content}", assistant_header="<｜Assistant｜>",
            assistant_fmt="{content}<｜end▁of▁sentence｜>",
            required_tokens=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                             "<｜end▁of▁sentence｜>"),
            reference="DeepSeek-V3 chat_template; LLaMA-Factory template 'deepseek3'"),
    )
}


def missing_tokens(tokenizer, tokens) -> list[str]:
    """Tokens that are not a single id of the tokenizer (not in its vocab, or split when encoded)."""
    vocab = tokenizer.get_vocab()
    missing = []
    for tok in tokens:
        tid = vocab.get(tok)
        if tid is None or list(tokenizer.encode(tok, add_special_tokens=False)) != [tid]:
            missing.append(tok)
    return missing


def resolve_template(name: str | ChatTemplate | None, tokenizer) -> ChatTemplate:
    """None: the tokenizer's own chat_template. A name: that named template, checked against the vocab."""
    if isinstance(name, ChatTemplate):
        return name
    if name is None or name in ("", "auto", "tokenizer"):
        if getattr(tokenizer, "chat_template", None):
            return JinjaTemplate(tokenizer)
        raise TemplateError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat_template (a base model?); "
            f"pass a template name, one of: {', '.join(TEMPLATES)}")
    key = str(name).lower()
    if key not in TEMPLATES:
        raise TemplateError(f"unknown chat template {name!r}; known: {', '.join(TEMPLATES)} "
                            f"(or leave it unset to use the tokenizer's own chat_template)")
    template = TEMPLATES[key]
    missing = missing_tokens(tokenizer, template.required_tokens)
    if missing:
        raise TemplateError(
            f"chat template {template.name!r} needs special tokens the tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?')}) does not have as single tokens: {', '.join(missing)}. "
            f"The template does not match this model family; pass the matching template, or leave it unset to "
            f"use the tokenizer's own chat_template")
    return template


# ------------------------------------------------------------------------------------------- masks

@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]        # unshifted: labels[t] = input_ids[t] where token t is trained, else -100
    method: str = "prefix"   # prefix | segmented | sentinel+prefix | sentinel+segmented
    pieces: list[tuple[str, bool]] = field(default_factory=list, repr=False)


def validate_messages(messages: list[dict]) -> None:
    """[system] then user/assistant alternating, starting with user, ending with assistant."""
    if not messages:
        raise TemplateError("empty conversation")
    body = messages[1:] if messages[0].get("role") == "system" else messages
    if not body:
        raise TemplateError("the conversation has only a system message")
    for k, m in enumerate(body):
        want = "user" if k % 2 == 0 else "assistant"
        if m.get("role") != want:
            raise TemplateError(f"message {k + (len(messages) - len(body))} has role {m.get('role')!r}, expected "
                                f"{want!r} (conversations alternate user/assistant after an optional system)")
        if not isinstance(m.get("content"), str):
            raise TemplateError(f"message {k + (len(messages) - len(body))} content must be a string")
    if body[-1]["role"] != "assistant":
        raise TemplateError("the conversation ends with a user message; it must end with an assistant answer")


def _chain_pieces(template: ChatTemplate, messages: list[dict]) -> tuple[list[tuple[str, bool]], bool]:
    prev = ""
    pieces: list[tuple[str, bool]] = []
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in answers:
        p = template.render(messages[:i], add_generation_prompt=True)
        f = template.render(messages[:i + 1], add_generation_prompt=False)
        if not (p.startswith(prev) and f.startswith(p)):
            return [], False
        pieces.append((p[len(prev):], False))
        pieces.append((f[len(p):], True))
        prev = f
    full = template.render(messages, add_generation_prompt=False)
    if not full.startswith(prev):
        return [], False
    if full[len(prev):]:
        pieces.append((full[len(prev):], False))
    return pieces, True


_SENTINEL = "\ue000AFANSWER{}\ue001"


def _sentinel_pieces(template: ChatTemplate, messages: list[dict]) -> list[tuple[str, bool]]:
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    deltas = []
    for i in answers:
        p = template.render(messages[:i], add_generation_prompt=True)
        f = template.render(messages[:i + 1], add_generation_prompt=False)
        if not f.startswith(p):
            raise TemplateError(f"chat template {template.name!r}: rendering an answer changes the text before it, "
                                f"so the assistant span cannot be found; pass a named template")
        deltas.append(f[len(p):])
    marked = [dict(m) for m in messages]
    for k, i in enumerate(answers):
        marked[i]["content"] = _SENTINEL.format(k)
    rendered = template.render(marked, add_generation_prompt=False)
    text, spans, cursor = "", [], 0
    for k, i in enumerate(answers):
        mark = _SENTINEL.format(k)
        pos = rendered.find(mark, cursor)
        if pos < 0 or rendered.count(mark) != 1:
            raise TemplateError(f"chat template {template.name!r} does not render assistant contents verbatim; "
                                f"pass a named template")
        text += rendered[cursor:pos]
        content = messages[i]["content"]
        start_in_delta = deltas[k].find(content)
        if start_in_delta < 0:
            raise TemplateError(f"chat template {template.name!r}: answer {k} is not rendered verbatim")
        start = len(text) - start_in_delta
        text += content
        cursor = pos + len(mark)
        spans.append((start, start + len(deltas[k])))
    text += rendered[cursor:]
    if text != template.render(messages, add_generation_prompt=False):
        raise TemplateError(f"chat template {template.name!r} renders contents differently from their text; "
                            f"pass a named template")
    pieces, last = [], 0
    for start, end in spans:
        if start < last or text[start:end] != deltas[len(pieces) // 2]:
            raise TemplateError(f"chat template {template.name!r}: cannot place assistant answer "
                                f"{len(pieces) // 2} in the full render; pass a named template")
        pieces.append((text[last:start], False))
        pieces.append((text[start:end], True))
        last = end
    if text[last:]:
        pieces.append((text[last:], False))
    return pieces


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict]) -> Encoded:
    """Token ids and unshifted labels of a conversation; every assistant turn trained (see module doc)."""
    validate_messages(messages)
    pieces, ok = _chain_pieces(template, messages)
    method = ""
    if not ok:
        pieces = _sentinel_pieces(template, messages)
        method = "sentinel+"
    if template.train_suffix:
        pieces.append((template.train_suffix, True))
    pieces = [(t, tr) for t, tr in pieces if t]
    full = "".join(t for t, _ in pieces)
    cuts, acc = [], 0
    for t, _ in pieces:
        acc += len(t)
        cuts.append(acc)
    encoded = tokenizer([full[:c] for c in cuts[:-1]] + [full], add_special_tokens=False,
                        return_attention_mask=False)["input_ids"]
    full_ids = list(encoded[-1])
    bounds = [len(ids) for ids in encoded[:-1]] + [len(full_ids)]
    prefix_ok = all(list(ids) == full_ids[:len(ids)] for ids in encoded[:-1]) and bounds == sorted(bounds)
    if prefix_ok:
        ids, labels, start = full_ids, [IGNORE_INDEX] * len(full_ids), 0
        for (_, trained), end in zip(pieces, bounds):
            if trained:
                labels[start:end] = ids[start:end]
            start = end
        return Encoded(ids, labels, method + "prefix", pieces)
    seg = tokenizer([t for t, _ in pieces], add_special_tokens=False, return_attention_mask=False)["input_ids"]
    ids, labels = [], []
    for (_, trained), part in zip(pieces, seg):
        ids.extend(part)
        labels.extend(part if trained else [IGNORE_INDEX] * len(part))
    return Encoded(ids, labels, method + "segmented", pieces)


# ------------------------------------------------------------------------------- thinking mode

def thinking_template(name: str | ChatTemplate | None, tokenizer, enable_thinking: bool | None) -> ChatTemplate:
    """The template for MindSpeed-LLM's --enable-thinking. A reasoning template (qwen3) opens every
    answer with an empty thinking block; with enable_thinking true that block belongs to the answer and
    is trained, otherwise (false, unset) it belongs to the prompt, as in LLaMA-Factory's reasoning
    templates. The tokens are the same either way; only the labels differ. (An answer that already
    holds its own thinking block still gets the empty one: data with reasoning needs the tokenizer's
    own template.)"""
    template = resolve_template(name, tokenizer)
    if enable_thinking and isinstance(template, NamedTemplate) and template.assistant_header.endswith(_EMPTY_THOUGHT):
        header = template.assistant_header[: -len(_EMPTY_THOUGHT)]
        return replace(template, assistant_header=header, assistant_fmt=_EMPTY_THOUGHT + template.assistant_fmt,
                       name=template.name + "+thinking")
    if enable_thinking and isinstance(template, JinjaTemplate):
        return JinjaTemplate(tokenizer, enable_thinking=True)
    return template


_EMPTY_THOUGHT = "<think>\n\n</think>\n\n"
