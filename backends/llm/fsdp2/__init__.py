"""MindSpeed-LLM's second backend: FSDP2 on Hugging Face models, in the dialect of its train_fsdp2.py
(one YAML with the sections model / data / parallel / training / optimization, `--section.key value`
overrides)."""
