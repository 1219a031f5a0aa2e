"""The framework adapters: one module per framework, found by name.

`FRAMEWORKS` is the list the job spec accepts; `adapter(name)` imports that framework's module
(its name with `-` → `_`) and returns its ADAPTER. A framework with several training backends
(`BACKENDS`) has one adapter per backend other than the first, in `<module>_<backend>`;
`job_adapter(job)` is the one lookup for a job, used wherever a job is at hand. Nothing outside
this package compares a framework name: the rest of ascendfactory asks the adapter.
"""

from __future__ import annotations

import importlib

FRAMEWORKS = ("mindspeed-llm", "llamafactory", "mindspeed-mm", "verl", "mindspeed-rl")
# the job field `backend`: MindSpeed-LLM trains on Megatron (mcore, the default) or on FSDP2 over Hugging Face models
BACKENDS = ("mcore", "fsdp2")
DEFAULT_BACKEND = BACKENDS[0]
FRAMEWORK_BACKENDS = {"mindspeed-llm": BACKENDS}   # every other framework has the default one only


def adapter(framework: str):
    """The Adapter of a framework (KeyError for a name that is not one)."""
    if framework not in FRAMEWORKS:
        raise KeyError(f"unknown framework {framework!r}; known: {', '.join(FRAMEWORKS)}")
    return importlib.import_module(f"{__name__}.{framework.replace('-', '_')}").ADAPTER


def adapters():
    return [adapter(name) for name in FRAMEWORKS]


def job_adapter(job):
    """The Adapter that renders and checks this job: its framework's, for its backend."""
    backend = getattr(job, "backend", DEFAULT_BACKEND)
    if backend == DEFAULT_BACKEND:
        return adapter(job.framework)
    if backend not in FRAMEWORK_BACKENDS.get(job.framework, ()):
        raise KeyError(f"framework {job.framework} has no backend {backend!r}")
    return importlib.import_module(f"{__name__}.{job.framework.replace('-', '_')}_{backend}").ADAPTER
