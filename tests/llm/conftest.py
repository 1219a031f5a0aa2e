"""Session-wide cache for the backends.llm end-to-end tests: the tiny models (the one-process reference
runs they hold their multi-process runs against: tests/conftest.py one_process)."""

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family, **hf_config) -> the directory of that tiny random HF model, written once
    (make_tiny_hf's default seed, so every test file that asks gets the same weights)."""
    from tests.helpers.tiny_hf import make_tiny_hf

    made = {}

    def get(family: str, **config):
        key = (family, tuple(sorted(config.items())))
        if key not in made:
            name = "-".join([family, *(f"{k}{v}" for k, v in sorted(config.items()))])
            made[key] = make_tiny_hf(family, tmp_path_factory.mktemp(name) / "model", **config)
        return made[key]

    return get
