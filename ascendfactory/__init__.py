"""AscendFactory: one YAML job file → validated, planned, rendered and launched training.

This package is the orchestrator. It is pure Python and never imports torch or transformers,
so `validate`, `capabilities` and `plan` are instant on any machine.
"""

__version__ = "0.1.0"
