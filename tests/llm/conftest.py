"""Session-wide caches for the backends.llm end-to-end tests: the tiny models and the one-process
reference runs that several test files hold their multi-process runs against (each made once)."""

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


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """one_process(spec) -> the run directory of `spec` (a job dict, its output_dir ignored) run
    through `ascendfactory run` on one process; the same job is run once per session."""
    import yaml

    from ascendfactory.spec import parse_job
    from tests.llm.test_engine_runs import run_job

    runs = {}

    def get(spec: dict):
        spec = {k: v for k, v in spec.items() if k != "output_dir"}
        assert spec.get("launcher") == "local", "a reference run is a one-process run"
        # the validated job, defaults filled in: the same job however the test spelled it
        key = parse_job(yaml.safe_dump(spec)).model_dump_json()
        if key not in runs:
            base = tmp_path_factory.mktemp("one-process")
            run_job(base, {**spec, "output_dir": str(base / "run")}, "ref.yaml")
            runs[key] = base / "run"
        return runs[key]

    return get
