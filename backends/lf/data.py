"""LLaMA-Factory's dataset registry (backends.common.data.dataset_info) and chat templates as this engine's
training file names them: errors are LFConfigError naming its keys, images checked by its mm plugin.
"""

from __future__ import annotations

from pathlib import Path

from backends.common.data import dataset_info
from backends.common.data.dataset_info import DatasetEntry
from backends.lf.config import LFConfig, LFConfigError
from backends.contract.prompts import LF_TEMPLATES

# LLaMA-Factory 0.9.5's template name -> ours of the same strings (backends.common.data.templates); gemma's
# text format is gemma3's (LF registers the same slots, without the image plugin)
TEMPLATES = LF_TEMPLATES


def read_dataset_info(cfg: LFConfig, key: str = "dataset") -> list[DatasetEntry]:
    """The entries of every dataset the training file names in `key` (dataset, eval_dataset), each checked
    against its file; a name given twice counts once (LF's loader keeps the datasets by name)."""
    return dataset_info.read_entries(cfg.names(key), cfg.dataset_dir, key, LFConfigError)


def media_dir(cfg: LFConfig) -> Path:
    """LLaMA-Factory's media_dir (default: dataset_dir)."""
    return Path(cfg.media_dir or cfg.dataset_dir)


def write_canonical(entries: list[DatasetEntry], stage: str, cache_root: Path,
                    media: Path | None = None, max_samples: int | None = None) -> tuple[Path, str]:
    """(a JSONL of every named dataset's canonical records, its format), content-addressed in the cache;
    max_samples: records kept of each dataset; image placeholders checked by the mm plugin."""
    from backends.lf.mm_plugin import check_placeholders

    return dataset_info.write_canonical(entries, stage, cache_root, media, max_samples, LFConfigError,
                                        check_placeholders)


def build_template(cfg: LFConfig, tokenizer):
    """The chat template the training file names (None for pre-training text), with LLaMA-Factory's
    enable_thinking and default_system."""
    from backends.common.data.templates import TemplateError, resolve_template

    if cfg.stage == "pt":
        return None
    try:
        return resolve_template(template_name(cfg), tokenizer, enable_thinking=cfg.enable_thinking,
                                default_system=cfg.default_system, preserve_thinking=cfg.preserve_thinking)
    except TemplateError as err:
        raise LFConfigError(f"template: {err}") from None


def template_name(cfg: LFConfig) -> str | None:
    """Our template for the training file's `template` (None: the tokenizer's own chat template)."""
    name = cfg.template
    if name is None or cfg.stage == "pt":  # pre-training text takes no template
        return None
    if name not in TEMPLATES:
        raise LFConfigError(f"template: {name!r} is not a template this engine implements (it has "
                            f"{', '.join(TEMPLATES)}); leave it unset to use the tokenizer's own chat template")
    return TEMPLATES[name]
