"""MindSpeed-RL's prompt_type templates (configs/model/templates.json) and how a prompt is laid out with one."""

from __future__ import annotations

from typing import Any

# ====================================================================== prompt templates
# MindSpeed-RL's configs/model/templates.json (LLaMA-Factory's formatters) for prompt_type, without the
# tool-calling templates; BOS stands for the tokenizer's bos token. Unset formatters take
# LLaMA-Factory's defaults: system "{content}", assistant "{content}" + EOS (none with efficient_eos).

BOS, EOS = ("bos_token",), ("eos_token",)
TEMPLATES: dict[str, dict[str, Any]] = {
    "default": {"user": ["Human: {content}\nAssistant:"], "system": ["{content}\n"], "separator": ["\n"]},
    "empty": {"user": ["{content}"], "assistant": ["{content}"]},
    "trl": {"user": ["{content}"], "assistant": ["{content}"], "prefix": [BOS]},
    "qwen": {"user": ["<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"],
             "system": ["<|im_start|>system\n{content}<|im_end|>\n"], "separator": ["\n"],
             "default_system": "You are a helpful assistant.", "stop": ["<|im_end|>"]},
    "qwen_r1": {"user": ["<|im_start|>user\nA conversation between User and Assistant. The user asks a question, and "
                         "the Assistant solves it. The assistant first thinks about the reasoning process in the mind "
                         "and then provides the user with the answer. The reasoning process and answer are enclosed "
                         "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
                         "process here </think><answer> answer here </answer>. Put your final answer within "
                         "\\boxed{}.\n{content}<|im_end|>\n<|im_start|>assistant\n"],
                "system": ["<|im_start|>system\n{content}<|im_end|>\n"], "separator": ["\n"],
                "default_system": "You are a helpful assistant.", "stop": ["<|im_end|>"]},
    "qwen_math_r1": {"user": ["<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"],
                     "system": ["<|im_start|>system\n{content}<|im_end|>\n"], "separator": ["\n"],
                     "default_system": "Please reason step by step, and put your final answer within \\boxed{}.",
                     "stop": ["<|im_end|>"]},
    "qwen3": {"user": ["<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"],
              "assistant": ["{content}<|im_end|>\n"], "system": ["<|im_start|>system\n{content}<|im_end|>\n"],
              "stop": ["<|im_end|>"]},
    "llama3": {"user": ["<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|><|start_header_id|>assistant"
                        "<|end_header_id|>\n\n"],
               "system": ["<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>"], "prefix": [BOS],
               "stop": ["<|eot_id|>"]},
    "mistral": {"user": ["[INST] {content} [/INST]"], "prefix": [BOS]},
    "mixtral": {"user": ["[INST] {content} [/INST]"], "prefix": [BOS]},
    "gemma": {"user": ["<start_of_turn>user\n{content}<end_of_turn>\n<start_of_turn>model\n"],
              "separator": ["<end_of_turn>\n"], "prefix": [BOS], "efficient_eos": True},
    "llama2": {"user": [BOS, "[INST] {content} [/INST]"], "system": ["<<SYS>>\n{content}\n<</SYS>>\n\n"],
               "system_in_user": True},
    "alpaca": {"user": ["### Instruction:\n{content}\n\n### Response:\n"], "separator": ["\n\n"],
               "default_system": "Below is an instruction that describes a task. Write a response that appropriately "
                                 "completes the request.\n\n"},
    "deepseek2": {"user": ["User: {content}\n\nAssistant:"], "system": ["{content}\n\n"], "prefix": [BOS]},
    "deepseek2-lite": {"user": ["User: {content}\n\nAssistant:"], "system": ["{content}\n\n"], "prefix": [BOS]},
    "minicpm3": {"user": ["User: {content}\n\nAssistant:"], "system": ["{content}\n\n"], "prefix": [BOS]},
    "baichuan2": {"user": ["<reserved_106>{content}<reserved_107>"], "efficient_eos": True},
    "deepseek3": {"user": ["<｜User｜>{content}<｜Assistant｜>"], "prefix": [BOS]},
    "deepseek3_r1": {"user": ["A conversation between User and Assistant. The user asks a question, and the Assistant "
                              "solves it. The assistant first thinks about the reasoning process in the mind and then "
                              "provides the user with the answer. The reasoning process and answer are enclosed within "
                              "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning "
                              "process here </think><answer> answer here </answer>. Put your final answer within "
                              "\\boxed{}. <｜User｜>{content}<｜Assistant｜>"], "prefix": [BOS]},
}


def _slots(slots: list, content: str = "") -> list:
    return [s.replace("{content}", content) if isinstance(s, str) else s for s in slots]


def prompt_parts(prompt_type: str | None, messages: list[dict]) -> list:
    """A prompt as LLaMA-Factory's Template._encode lays it out (MindSpeed-RL's preprocessing): the
    prefix and the system turn (the message's, else the template's default system) before the first
    message, a separator before each later user turn -> strings and BOS / EOS markers, each encoded
    on its own. No template (prompt_type null): the messages' text as it is. Qwen3's template is read
    with thinking enabled (no empty think block appended; MindSpeed-RL's preprocessing decides that
    with enable_thinking, outside this file)."""
    system = next((m["content"] for m in messages if m["role"] == "system"), None)
    turns = [m for m in messages if m["role"] != "system"]
    if prompt_type is None:
        return ([system] if system else []) + [m["content"] for m in turns]
    t = TEMPLATES[prompt_type]
    system = system or t.get("default_system", "")
    assistant = t.get("assistant") or ["{content}"] + ([] if t.get("efficient_eos") else [EOS])
    parts: list = []
    for i, message in enumerate(turns):
        system_text = ""
        if i == 0:
            parts += t.get("prefix", [])
            if system:
                if t.get("system_in_user"):
                    system_text = _slots(t.get("system", ["{content}"]), system)[0]
                else:
                    parts += _slots(t.get("system", ["{content}"]), system)
        elif i % 2 == 0:
            parts += t.get("separator", [])
        slots = t["user"] if message["role"] == "user" else assistant
        parts += _slots(slots, system_text + message["content"] if message["role"] == "user" else message["content"])
    return parts


def stop_words(prompt_type: str | None) -> list[str]:
    return list(TEMPLATES.get(prompt_type or "", {}).get("stop", []))
