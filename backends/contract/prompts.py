"""MindSpeed-LLM's --prompt-type names and the engines' chat templates (backends.common.data.templates, which follow
LLaMA-Factory's templates of those names): one table for the renderer and the engine."""

from __future__ import annotations

# --prompt-type -> the chat template of the same format
PROMPT_TYPE_TEMPLATES = {"qwen": "qwen", "qwen3": "qwen3", "llama3": "llama3", "glm4": "glm4", "mistral": "mistral",
                         "deepseek3": "deepseek"}

# a job's data.template (a template name, or MindSpeed-LLM's own spelling of it) -> the --prompt-type rendered
TEMPLATE_PROMPT_TYPES = {**{template: prompt_type for prompt_type, template in PROMPT_TYPE_TEMPLATES.items()},
                         **{prompt_type: prompt_type for prompt_type in PROMPT_TYPE_TEMPLATES}}
