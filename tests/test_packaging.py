"""The orchestrator stays torch-free and fast to import; a wheel ships its data folders."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NO_TORCH = """
import sys
from typer.testing import CliRunner
from ascendfactory.cli import app
r = CliRunner()
for args in (["capabilities", "--model", "qwen3-32b"], ["validate", "examples/mindspeed-llm/sft.yaml"],
             ["plan", "examples/mindspeed-llm/sft.yaml"], ["models"], ["render", "examples/verl/qwen3-14b-grpo-vllm.yaml", "-o", sys.argv[1]],
             ["matrix", "check"], ["runs", sys.argv[1]]):
    res = r.invoke(app, args)
    assert res.exit_code == 0, (args, res.output)
heavy = [m for m in ("torch", "transformers", "numpy", "safetensors") if m in sys.modules]
assert not heavy, heavy
print("ok")
"""


def test_commands_never_import_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", NO_TORCH, str(tmp_path / "r")], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok")


def test_wheel_ships_matrix_and_templates(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("ascendfactory-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("ascendfactory/capability_matrix/models.yaml", "ascendfactory/capability_matrix/verl.yaml",
                   "ascendfactory/templates/launch/torchrun.sh.j2", "ascendfactory/templates/engines/verl.yaml.j2",
                   "ascendfactory/cli.py", "backends/__init__.py"):
        assert needed in names, needed
    # installed from the wheel, outside the source tree, the package still finds its data
    target = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
    probe = ("from ascendfactory.resources import matrix_dir, templates_dir; import ascendfactory;"
             "assert str(matrix_dir()).startswith(%r), matrix_dir(); print(templates_dir())") % str(target)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
