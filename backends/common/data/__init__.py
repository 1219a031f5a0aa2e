"""The data pipeline: tokenizer + chat templates -> records -> Megatron indexed dataset (cached)
-> packed / padded / dynamic micro-batches sharded over data-parallel ranks.

    tok = load_tokenizer("examples/tiny-qwen3")
    handle = preprocess("examples/data/arithmetic_alpaca.json", "alpaca", tok, None, 128, "cache/")
    loader = MicroBatchLoader(handle, mode="packed", micro_batch=8, seq_len=128, dp_rank=r, dp_world=w,
                              seed=0, shuffle=True, pad_id=pad_id(tok))
    batch = next(loader)   # see loader.py for the batch contract (labels are already shifted)
"""

from .formats import FORMATS, DataFormatError, iter_records
from .indexed import IndexedDataset, IndexedDatasetWriter, IndexedFormatError
from .loader import MODES, MicroBatchLoader, shift_labels
from .packing import PackStats, best_fit_decreasing, pack_stats
from .preprocess import DatasetHandle, TokenDataset, preprocess
from .conversation import encode_conversation
from .templates import IGNORE_INDEX, TEMPLATES, ChatTemplate, JinjaTemplate, TemplateError, resolve_template
from .tokenizer import eod_id, load_tokenizer, pad_id

__all__ = [
    "FORMATS", "IGNORE_INDEX", "MODES", "TEMPLATES", "ChatTemplate", "DataFormatError", "DatasetHandle",
    "IndexedDataset", "IndexedDatasetWriter", "IndexedFormatError", "JinjaTemplate", "MicroBatchLoader",
    "PackStats", "TemplateError", "TokenDataset", "best_fit_decreasing", "encode_conversation", "eod_id",
    "iter_records", "load_tokenizer", "pack_stats", "pad_id", "preprocess", "resolve_template", "shift_labels",
]
