"""MindSpeed-LLM's --prompt-type names and the engines' chat templates (backends.common.data.templates, which follow
LLaMA-Factory's templates of those names): one table for the renderer and the engine."""

from __future__ import annotations

# --prompt-type -> the chat template of the same format (MindSpeed-LLM's configs/finetune/templates.json: its
# mixtral is its mistral, "[INST] {content} [/INST]"; deepseek2 and deepseek2-lite are LLaMA-Factory's deepseek)
PROMPT_TYPE_TEMPLATES = {"qwen": "qwen", "qwen3": "qwen3", "llama3": "llama3", "glm4": "glm4", "mistral": "mistral",
                         "mixtral": "mistral", "deepseek2": "deepseek2", "deepseek2-lite": "deepseek2",
                         "deepseek3": "deepseek"}

# a job's data.template (a template name, or MindSpeed-LLM's own spelling of it) -> the --prompt-type rendered;
# a template several prompt types share renders the first of them
TEMPLATE_PROMPT_TYPES = {**{prompt_type: prompt_type for prompt_type in PROMPT_TYPE_TEMPLATES}}
for _prompt_type, _template in PROMPT_TYPE_TEMPLATES.items():
    TEMPLATE_PROMPT_TYPES.setdefault(_template, _prompt_type)

# LLaMA-Factory 0.9.5's template names that backends.lf implements -> the engines' chat template of that format
# (backends.common.data.templates); the llamafactory adapter accepts a job's data.template from the same table
LF_TEMPLATES = {"qwen": "qwen", "qwen3": "qwen3", "qwen3_nothink": "qwen3_nothink", "qwen2_vl": "qwen2_vl",
                "llama3": "llama3", "glm4": "glm4", "gemma": "gemma3", "gemma3": "gemma3", "mistral": "mistral_v3",
                "deepseek": "deepseek2", "deepseek3": "deepseek", "default": "lf_default", "empty": "empty"}
