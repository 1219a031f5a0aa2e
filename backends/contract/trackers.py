"""The experiment trackers the engines write to (TensorBoard event files, Weights & Biases runs), stdlib only:
their names, the package each needs, and the one refusal when a tracker is asked for but not installed. The
job file (train.report_to), every engine's dialect keys and the engine kit (backends.common.trackers) share it.
"""

from __future__ import annotations

import importlib.util

TRACKERS = ("tensorboard", "wandb")
# the module each one imports (torch.utils.tensorboard needs the tensorboard package)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
INSTALL = "pip install 'ascendfactory[trackers]'"


def installed(tracker: str) -> bool:
    try:
        return importlib.util.find_spec(PACKAGES[tracker]) is not None
    except (ImportError, ValueError):
        return False


def not_installed(trackers) -> list[str]:
    return [name for name in dict.fromkeys(trackers) if not installed(name)]


def missing(key: str, trackers) -> list[str]:
    """One line per tracker of `trackers` that is not installed here, naming the key that asks for it."""
    return [f"{key}: {name} is asked for, but the {PACKAGES[name]} package is not installed; {INSTALL}"
            for name in not_installed(trackers)]
