import sys

# a YAML first argument selects MindSpeed-LLM's FSDP2 dialect (train_fsdp2.py); Megatron flags stay Mcore's
if len(sys.argv) > 1 and sys.argv[1].endswith((".yaml", ".yml")):
    from backends.llm.fsdp2.recipe import main
else:
    from backends.llm.recipe import main

sys.exit(main())
