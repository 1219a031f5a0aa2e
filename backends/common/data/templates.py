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
  qwen3    ChatML with no default system, a reasoning template as LLaMA-Factory's and MindSpeed-LLM's
           `qwen3`: an answer without thinking of its own gets the empty block
           "<think>\\n\\n</think>\\n\\n": trained at the start of the answer with enable_thinking=True
           (LF's default), in the prompt otherwise; enable_thinking=False also strips every answer's
           <think>...</think>; None (MindSpeed-LLM's default) keeps them. <think> need not be one token
           (the block is then plain text, as in LF). Qwen3's own Jinja writes the block only on the
           turns after the last user message; pass template=None to get exactly that.
  llama3   Llama-3-Instruct: <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n
           {content}<|eot_id|> (no default system; Llama 3.1's date preamble is not added). Contents
           are kept verbatim as LLaMA-Factory does (Meta's Jinja trims them; data written for it
           should be trimmed beforehand).
  glm4     GLM-4-9B-Chat: [gMASK]<sop><|system|>\\n{s}<|user|>\\n{u}<|assistant|>\\n{a}; the turn has
           no end marker (generation stops at the next <|user|>), so, as GLM-4's fine-tuning code
           and LLaMA-Factory (efficient_eos), the EOS <|endoftext|> closes the conversation, trained,
           and is the label of each later user turn's first token (the answer before it learns to
           stop); train_on_prompt is refused, as LLaMA-Factory does.
  mistral  Mistral-7B/Mixtral-8x7B-Instruct-v0.1, MindSpeed-LLM `mistral` / `mixtral` (LF 0.9.5's is mistral_v3):
           <s>[INST] {u} [/INST]{a}</s>; a system prompt goes before the first user message as
           "{system}\\n\\n{user}" (Mistral's later templates' convention; v0.1 has no system role).
  deepseek DeepSeek-V3 / R1: <｜begin▁of▁sentence｜>{system}<｜User｜>{u}<｜Assistant｜>{a}
           <｜end▁of▁sentence｜> (no default system; the system text follows BOS unmarked)
  qwen2_vl Qwen2-VL-Instruct and LLaMA-Factory `qwen2_vl`, text only (no image/video tokens are
           expanded): ChatML with the default system "You are a helpful assistant."
  gemma3   Gemma-3-it and LLaMA-Factory `gemma3`, text only: <bos><start_of_turn>user\\n{u}<end_of_turn>\\n
           <start_of_turn>model\\n{a}<end_of_turn>\\n; a system prompt goes into the first user turn
           as "{system}\\n\\n{user}" (no default system)
  qwen3_nothink  LLaMA-Factory `qwen3_nothink`: qwen3's ChatML without the reasoning block (answers verbatim)
  deepseek2  DeepSeek-V2(-Lite)-Chat, LLaMA-Factory `deepseek`, MindSpeed-LLM `deepseek2(-lite)`:
           {bos}{system}\\n\\nUser: {u}\\n\\nAssistant:{a}{eos}
  mistral_v3 LLaMA-Factory 0.9.5 `mistral`: {bos}[INST] {system}\\n\\n{u}[/INST] {a}{eos}
  lf_default LLaMA-Factory `default`: System: {s}{eos}\\nHuman: {u}{eos}\\nAssistant:{a}{eos}\\n
  empty    LLaMA-Factory / MindSpeed-LLM `empty`: the contents alone, no markers, no EOS

{bos} / {eos} are the tokenizer's own BOS / EOS (LF's bos_token / eos_token slots; no BOS gives nothing),
filled in by resolve_template. The user message and the assistant header are one piece, tokenized as one
(LF's user slot holds both).

A named template whose special tokens do not encode as single tokens of the tokenizer raises
`TemplateError` naming them (a Llama 3 template on a Qwen tokenizer fails at once, not silently).

How a conversation becomes ids and labels: conversation.py (pieces, token boundaries) and turns.py
(LLaMA-Factory's per-turn assembly: cutoff_len, train_on_prompt, mask_history, efficient EOS).
Every assistant turn is trained; system, user and template text is -100.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

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

    thought_words: tuple[str, str] = ()   # a reasoning template's (open, close) of a thinking block
    enable_thinking: bool | None = None   # reasoning templates only, see pieces()
    preserve_thinking: bool = False       # reasoning templates: earlier answers keep their thoughts (LF 0.9.5)

    def render(self, messages, add_generation_prompt=False):
        out = "".join(text for text, _, _ in self.pieces(messages))
        if add_generation_prompt:
            out += self.assistant_header
            if self.thought_words and not self.enable_thinking:
                out += self.empty_thought
        return out

    @property
    def empty_thought(self) -> str:
        return "".join(self.thought_words)

    def pieces(self, messages, mode="multiturn"):
        """(text, kind, turn) pieces in LLaMA-Factory's grouping: turn 0's source is prefix + system +
        user + header, each later turn's source is its user message + header; the target is the
        answer with its end-of-turn marker. A reasoning template (LF's ReasoningTemplate) adds the
        empty thinking block to an answer that has no thinking of its own: trained, at the start of
        the answer, with enable_thinking true; else in the prompt. enable_thinking false also strips
        every answer's thinking. mode "mask_history" / "oneturn" (pairwise) strips the thinking of
        every answer but the last and gives the empty block to the last one only."""
        if any(slot in text for text in self._texts() for slot in ("{bos}", "{eos}")):
            raise TemplateError(f"chat template {self.name!r} takes its BOS / EOS from the tokenizer: get it "
                                "through resolve_template(name, tokenizer)")
        msgs = list(messages)
        system = self.default_system
        if msgs and msgs[0]["role"] == "system":
            system = msgs[0]["content"]
            msgs = msgs[1:]
        last = max((k for k, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
        out = [(self.prefix, "source", 0)]
        if system and not self.system_in_first_user:
            out.append((self.system_fmt.format(content=system), "source", 0))
        turn = 0
        for k, m in enumerate(msgs):
            if m["role"] == "user":
                content = m["content"]
                if k == 0 and system and self.system_in_first_user:
                    content = self.system_in_first_user.format(system=system, content=content)
                # LF's user slot ends with the assistant header: one text, tokenized as one
                answered = k + 1 < len(msgs) and msgs[k + 1]["role"] == "assistant"
                out.append((self.user_fmt.format(content=content) + (self.assistant_header if answered else ""),
                            "source", turn))
            elif m["role"] == "assistant":
                content, block = self._thinking(m["content"], mode, k == last)
                if block:  # its own piece: LF tokenizes the block apart from the text around it
                    out.append((block, "target" if self.enable_thinking else "source", turn))
                out.append((self.assistant_fmt.format(content=content), "target", turn))
                turn += 1
            else:
                raise TemplateError(f"template {self.name!r}: a system message may only come first")
        return out

    def _thinking(self, content: str, mode: str, is_last: bool) -> tuple[str, str]:
        """(the answer as encoded, the empty thinking block to add or ""). As LF's ReasoningTemplate: an
        earlier answer of "oneturn" (pairwise) or of "mask_history" is history: no empty block, its thought
        stripped, unless preserve_thinking (which makes mask_history encode as multiturn). enable_thinking
        false strips every answer's thought ("oneturn": the last one's only)."""
        if not self.thought_words:
            return content, ""
        keep = self.preserve_thinking
        history = not is_last and (mode == "oneturn" or (mode == "mask_history" and not keep))
        opening, closing = self.thought_words
        if (self.enable_thinking is False and (mode != "oneturn" or is_last)) or (history and not keep):
            pattern = re.escape(opening) + "(.*?)" + re.escape(closing)
            content = re.sub(pattern, "", content, flags=re.DOTALL).lstrip("\n")
        if history or opening.strip() in content or closing.strip() in content:
            return content, ""
        return content, self.empty_thought

    def bind(self, tokenizer) -> "NamedTemplate":
        """The template with its {bos} / {eos} slots (LF's {"bos_token"} / {"eos_token"}) made the tokenizer's
        tokens: no BOS gives nothing (as in LF), the EOS must be one token of the tokenizer."""
        if not any(_SLOT in text for text in self._texts() for _SLOT in ("{bos}", "{eos}")):
            return self
        bos, eos = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
        if eos is None and any("{eos}" in text for text in self._texts()):
            raise TemplateError(f"chat template {self.name!r} ends turns with the tokenizer's EOS token, and "
                                f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has none")

        def fill(text: str, braces: bool = True) -> str:
            def tok(t):
                return (t or "").replace("{", "{{").replace("}", "}}") if braces else (t or "")
            return text.replace("{bos}", tok(bos)).replace("{eos}", tok(eos))

        fields = {f: fill(getattr(self, f)) for f in ("system_fmt", "user_fmt", "assistant_fmt",
                                                      "system_in_first_user")}
        fields.update({f: fill(getattr(self, f), braces=False) for f in ("prefix", "assistant_header",
                                                                          "train_suffix")})
        used = [t for t, slot in ((bos, "{bos}"), (eos, "{eos}")) if t and any(slot in x for x in self._texts())]
        return replace(self, **fields, required_tokens=tuple(dict.fromkeys((*self.required_tokens, *used))))

    def _texts(self) -> tuple[str, ...]:
        return (self.prefix, self.system_fmt, self.user_fmt, self.assistant_header, self.assistant_fmt,
                self.system_in_first_user, self.train_suffix)

    def fingerprint(self):
        return "named:" + hashlib.sha256(repr(self).encode()).hexdigest()

    def __repr__(self):  # dataclass repr includes every field: a stable definition hash
        fields = (self.name, self.prefix, self.system_fmt, self.user_fmt, self.assistant_header, self.assistant_fmt,
                  self.required_tokens, self.default_system, self.system_in_first_user, self.train_suffix,
                  self.thought_words, self.enable_thinking, self.preserve_thinking)
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
            assistant_header="<|im_start|>assistant\n", assistant_fmt="{content}<|im_end|>\n",
            thought_words=("<think>\n", "\n</think>\n\n"), required_tokens=_CHATML_TOKENS,
            reference="LLaMA-Factory / MindSpeed-LLM template 'qwen3' (ReasoningTemplate)"),
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
            reference="Mistral-7B-Instruct-v0.1 / Mixtral-8x7B-Instruct-v0.1; MindSpeed-LLM mistral / mixtral"),
        NamedTemplate(
            name="deepseek", prefix="<｜begin▁of▁sentence｜>", system_fmt="{content}",
            user_fmt="<｜User｜>{content}", assistant_header="<｜Assistant｜>",
            assistant_fmt="{content}<｜end▁of▁sentence｜>",
            required_tokens=("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                             "<｜end▁of▁sentence｜>"),
            reference="DeepSeek-V3 chat_template; LLaMA-Factory template 'deepseek3'"),
        NamedTemplate(
            name="qwen2_vl", prefix="",
            system_fmt="<|im_start|>system\n{content}<|im_end|>\n",
            user_fmt="<|im_start|>user\n{content}<|im_end|>\n",
            assistant_header="<|im_start|>assistant\n", assistant_fmt="{content}<|im_end|>\n",
            default_system="You are a helpful assistant.", required_tokens=_CHATML_TOKENS,
            reference="Qwen2-VL-Instruct chat_template (text); LLaMA-Factory template 'qwen2_vl'"),
        NamedTemplate(
            name="gemma3", prefix="<bos>", system_fmt="", system_in_first_user="{system}\n\n{content}",
            user_fmt="<start_of_turn>user\n{content}<end_of_turn>\n",
            assistant_header="<start_of_turn>model\n", assistant_fmt="{content}<end_of_turn>\n",
            required_tokens=("<bos>", "<start_of_turn>", "<end_of_turn>"),
            reference="Gemma-3-it chat_template (text); LLaMA-Factory template 'gemma3'"),
        NamedTemplate(
            name="qwen3_nothink", prefix="",
            system_fmt="<|im_start|>system\n{content}<|im_end|>\n",
            user_fmt="<|im_start|>user\n{content}<|im_end|>\n",
            assistant_header="<|im_start|>assistant\n", assistant_fmt="{content}<|im_end|>\n",
            required_tokens=_CHATML_TOKENS,
            reference="LLaMA-Factory template 'qwen3_nothink' (qwen3 without the reasoning block)"),
        NamedTemplate(
            name="deepseek2", prefix="{bos}", system_fmt="{content}\n\n",
            user_fmt="User: {content}\n\n", assistant_header="Assistant:", assistant_fmt="{content}{eos}",
            required_tokens=(),
            reference="DeepSeek-V2 / V2-Lite-Chat; LLaMA-Factory template 'deepseek', MindSpeed-LLM --prompt-type "
                      "deepseek2 / deepseek2-lite"),
        NamedTemplate(
            name="mistral_v3", prefix="{bos}", system_fmt="", system_in_first_user="{system}\n\n{content}",
            user_fmt="[INST] {content}[/INST]", assistant_header="", assistant_fmt=" {content}{eos}",
            required_tokens=(),
            reference="LLaMA-Factory 0.9.5 template 'mistral' (Mistral's v3 tokenizer format)"),
        NamedTemplate(
            name="lf_default", prefix="", system_fmt="System: {content}{eos}\n",
            user_fmt="Human: {content}{eos}", assistant_header="\nAssistant:", assistant_fmt="{content}{eos}\n",
            required_tokens=(), reference="LLaMA-Factory template 'default' (MindSpeed-LLM's --prompt-type default "
                                            "differs: no EOS after the user turn)"),
        NamedTemplate(
            name="empty", prefix="", system_fmt="{content}", user_fmt="{content}", assistant_header="",
            assistant_fmt="{content}", required_tokens=(), reference="LLaMA-Factory template 'empty'"),
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


def resolve_template(name: str | ChatTemplate | None, tokenizer, *, enable_thinking: bool | None = None,
                     default_system: str | None = None, preserve_thinking: bool | None = None) -> ChatTemplate:
    """None: the tokenizer's own chat_template. A name: that named template, checked against the vocab.
    enable_thinking: a reasoning template's switch (NamedTemplate.pieces; for the tokenizer's own
    template, passed to its Jinja: true renders thinking, else it is off). default_system replaces a
    named template's default system prompt (as LLaMA-Factory's default_system argument); preserve_thinking:
    a reasoning template's earlier answers keep their thoughts (LLaMA-Factory's preserve_thinking)."""
    if isinstance(name, ChatTemplate):
        return name
    if name is None or name in ("", "auto", "tokenizer"):
        if getattr(tokenizer, "chat_template", None):
            return JinjaTemplate(tokenizer, enable_thinking=True) if enable_thinking else JinjaTemplate(tokenizer)
        raise TemplateError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat_template (a base model?); "
            f"pass a template name, one of: {', '.join(TEMPLATES)}")
    key = str(name).lower()
    if key not in TEMPLATES:
        raise TemplateError(f"unknown chat template {name!r}; known: {', '.join(TEMPLATES)} "
                            f"(or leave it unset to use the tokenizer's own chat_template)")
    template = TEMPLATES[key].bind(tokenizer)
    missing = missing_tokens(tokenizer, template.required_tokens)
    if missing:
        raise TemplateError(
            f"chat template {template.name!r} needs special tokens the tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?')}) does not have as single tokens: {', '.join(missing)}. "
            f"The template does not match this model family; pass the matching template, or leave it unset to "
            f"use the tokenizer's own chat_template")
    if template.thought_words and enable_thinking is not None:
        template = replace(template, enable_thinking=enable_thinking)
    if template.thought_words and preserve_thinking is not None:
        template = replace(template, preserve_thinking=bool(preserve_thinking))
    if default_system is not None:
        template = replace(template, default_system=default_system)
    return template
