"""The 35 model ids the seed tables name (DESIGN.md id rule; combined Llama rows split), in seed order."""

MODEL_IDS = [
    "deepseek-r1-671b", "deepseek-v3-671b", "deepseek-v2-lite-16b",
    "qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2-72b",
    "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b",
    "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
    "qwen3-30b-a3b", "qwen3-235b-a22b",
    "llama3.1-8b", "llama3.1-70b", "llama3.2-1b", "llama3.2-3b",
    "glm-4-9b-chat", "mixtral-8x7b-instruct-v0.1",
    "qwen2-vl-2b", "qwen2-vl-7b", "qwen2-vl-72b",
    "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "qwen2.5-vl-72b",
    "gemma3-27b",
]
