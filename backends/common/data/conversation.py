"""A conversation's token ids, split in turns, and its labels (every answer trained, the rest -100).

Pieces: a conversation becomes a list of (text, kind, turn) pieces, kind "source" (prefix, system,
user message, assistant header: masked), "target" (the answer and its end-of-turn marker: trained)
or "tail" (text after the last answer: masked). A named template lists its pieces itself, as
LLaMA-Factory lists a message's elements (templates.NamedTemplate.pieces). Any other template (the
tokenizer's Jinja) is rendered: for every assistant message i the template renders the prefix
P_i = messages[:i] with the generation prompt and F_i = messages[:i+1]; the pieces P_i - F_{i-1}
(source) and F_i - P_i (target) tile the full render exactly when every render is a string prefix of
the next; that is checked. Templates that rewrite earlier turns (Qwen3's own drops the thinking block
from older turns, so F_1 is not a prefix of P_2) are rendered once with each answer replaced by a
unique sentinel: the sentinels place every answer in the real render, each answer span is F_i - P_i
found at its sentinel, and the render with the real contents must equal the plain render
(`method == "sentinel..."`); if not, a `TemplateError` says so.

Tokens: the whole text is tokenized once and every piece boundary is checked to be a token boundary
(the ids of each prefix text must be a prefix of the ids of the whole). When it holds, the canonical
tokenization is kept (`method == "prefix"`). When a BPE merge crosses a boundary, the pieces are
tokenized one by one and concatenated (LLaMA-Factory's way; `method == "segmented"`).

The ids of each piece are grouped into `turns.Turn`s; turns.assemble builds the sample from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .templates import IGNORE_INDEX, ChatTemplate, TemplateError
from .turns import Turn, assemble

MODES = ("multiturn", "mask_history", "oneturn")


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]        # unshifted: labels[t] = input_ids[t] where token t is trained, else -100
    method: str = "prefix"   # prefix | segmented | sentinel+prefix | sentinel+segmented
    pieces: list[tuple[str, str, int]] = field(default_factory=list, repr=False)
    turns: list[Turn] = field(default_factory=list, repr=False)
    suffix: list[int] = field(default_factory=list, repr=False)   # the trained EOS of efficient-EOS templates


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


def _chain_pieces(template: ChatTemplate, messages: list[dict]) -> list[tuple[str, str, int]] | None:
    prev = ""
    pieces = []
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for turn, i in enumerate(answers):
        p = template.render(messages[:i], add_generation_prompt=True)
        f = template.render(messages[:i + 1], add_generation_prompt=False)
        if not (p.startswith(prev) and f.startswith(p)):
            return None
        pieces += [(p[len(prev):], "source", turn), (f[len(p):], "target", turn)]
        prev = f
    full = template.render(messages, add_generation_prompt=False)
    if not full.startswith(prev):
        return None
    return pieces + [(full[len(prev):], "tail", len(answers) - 1)]


_SENTINEL = "\ue000AFANSWER{}\ue001"


def _sentinel_pieces(template: ChatTemplate, messages: list[dict]) -> list[tuple[str, str, int]]:
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
    for turn, (start, end) in enumerate(spans):
        if start < last or text[start:end] != deltas[turn]:
            raise TemplateError(f"chat template {template.name!r}: cannot place assistant answer "
                                f"{turn} in the full render; pass a named template")
        pieces += [(text[last:start], "source", turn), (text[start:end], "target", turn)]
        last = end
    return pieces + [(text[last:], "tail", len(spans) - 1)]


def _piece_ids(tokenizer, texts: list[str]) -> tuple[list[list[int]], str]:
    """The ids of each text: cut from the canonical tokenization of the whole when every boundary is a
    token boundary ("prefix"), else each text tokenized alone ("segmented")."""
    full = "".join(texts)
    cuts, acc = [], 0
    for t in texts:
        acc += len(t)
        cuts.append(acc)
    encoded = tokenizer([full[:c] for c in cuts[:-1]] + [full], add_special_tokens=False,
                        return_attention_mask=False)["input_ids"]
    full_ids = list(encoded[-1])
    bounds = [len(ids) for ids in encoded[:-1]] + [len(full_ids)]
    if all(list(ids) == full_ids[:len(ids)] for ids in encoded[:-1]) and bounds == sorted(bounds):
        return [full_ids[a:b] for a, b in zip([0] + bounds[:-1], bounds)], "prefix"
    seg = tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return [list(ids) for ids in seg], "segmented"


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict], mode: str = "multiturn") -> Encoded:
    """Token ids, turns and unshifted labels of a conversation; every assistant turn trained (module doc).
    mode: how a reasoning template treats thoughts (templates.NamedTemplate.pieces); the others ignore it."""
    validate_messages(messages)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    method = ""
    if hasattr(template, "pieces"):
        pieces = template.pieces(messages, mode)
    else:
        pieces = _chain_pieces(template, messages)
        if pieces is None:
            pieces = _sentinel_pieces(template, messages)
            method = "sentinel+"
    if template.train_suffix:
        pieces.append((template.train_suffix, "suffix", -1))
    pieces = [p for p in pieces if p[0]]
    ids, how = _piece_ids(tokenizer, [t for t, _, _ in pieces])
    n_turns = sum(1 for m in messages if m["role"] == "assistant")
    turns = [Turn([], [], []) for _ in range(n_turns)]
    suffix: list[int] = []
    for (_, kind, turn), part in zip(pieces, ids):
        if kind == "source":
            turns[turn].source += part
        elif kind == "target":
            turns[turn].target += part
            turns[turn].target_labels += part
        elif kind == "tail":
            turns[turn].target += part
            turns[turn].target_labels += [IGNORE_INDEX] * len(part)
        else:
            suffix += part
    input_ids, labels = assemble(turns, suffix)
    return Encoded(input_ids, labels, method + how, pieces, turns, suffix)
