"""`python -m backends.llm.preprocess <the engine's flags>`: tokenize into the cache, nothing else.

MindSpeed-LLM runs preprocess_data.py before training; this is that step on its own. It prints
one JSON object a line on stdout ({"progress": done, "total": n}, then {"event": "preprocessed", …})
so `ascendfactory preprocess` can draw a progress bar.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from backends.llm.config import ConfigError, parse_args


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"backends.llm.preprocess: error: {err}", file=sys.stderr)
        return 2
    from backends.common.data import load_tokenizer, preprocess

    d = cfg.data
    tokenizer = load_tokenizer(cfg.model.tokenizer) if cfg.model.tokenizer else None
    last = [-1]

    def progress(done: int, total: int) -> None:
        if done == total or done - last[0] >= max(total // 100, 1):
            last[0] = done
            print(json.dumps({"progress": done, "total": total}), flush=True)

    try:
        handle = preprocess(d.input or d.prefix, d.fmt, tokenizer, d.template, d.seq_len, Path(d.prefix).parent,
                            max_samples=d.max_samples, progress=progress)
    except (ValueError, FileNotFoundError) as err:
        print(f"backends.llm.preprocess: error: {err}", file=sys.stderr)
        return 2
    s = handle.stats
    print(json.dumps({"event": "preprocessed", "path": handle.data_path, "samples": s.get("samples"),
                      "tokens": s.get("tokens"), "truncated": s.get("truncated", 0), "reused": handle.from_cache,
                      "summary": handle.summary()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
