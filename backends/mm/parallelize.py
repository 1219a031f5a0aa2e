"""Qwen2.5-VL's parallel setup in backends.mm, applied from outside the model by backends.common.parallel on
the blocks the model declares (`parts()`: the text decoder; `vision_parts()`: the vision encoder).

    apply_recompute(vl, parts)   recompute per part, as model.json / the Megatron flags set it (config.Part)
"""

from __future__ import annotations

import logging

from backends.common.parallel import recompute
from backends.mm.config import ConfigError

log = logging.getLogger("backends.mm")


def apply_recompute(vl, parts, chunks: dict | None = None) -> dict[str, int]:
    """Full / selective recompute of the vision encoder's and the text decoder's blocks, each by its own
    setting -> checkpoints made per part. chunks: part -> its blocks per pipeline stage of this rank."""
    made = {}
    for name, declared in (("vision_encoder", vl.vision_parts()), ("text_decoder", vl.parts())):
        part = parts[name]
        if part.recompute == "none":
            continue
        try:
            made[name] = recompute.apply_recompute(declared, part.recompute, method=part.recompute_method,
                                                   num_layers=part.recompute_num_layers,
                                                   chunks=(chunks or {}).get(name))
        except ValueError as err:
            raise ConfigError(f"{name} recompute: {err}") from None
        log.info("recompute %s of the %s: %d checkpoints", part.recompute, name, made[name])
    return made
