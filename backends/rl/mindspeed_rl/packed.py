"""MindSpeed-RL's preprocessed prompts (cli/preprocess_data.py, R1AlpacaStyleInstructionHandler) and the order its
loader draws them in (public repo, commit 05a90d77, mindspeed_rl/datasets/).

The handler writes one Megatron indexed dataset per field, `<data_path>_packed_<field>_document.{bin,idx}`:
`input_ids` (the templated prompt's token ids), `attention_mask` and each of `dataset_additional_keys`
(`labels`: the answer's token ids, no special tokens), one sequence per prompt. get_packed_indexed_dataset drops
the prompts whose input_ids are not shorter than rl_config.max_prompt_length, from every field; PromptDataset
cuts input_ids to seq_length; the verifier compares with the labels decoded by batch_decode(skip_special_tokens).

The order: PromptDataset repeats the train documents, in order, until train_iters x global_batch_size samples
(_build_index_mappings, no_shuffle=True); PromptDataLoader draws from that whole list with a RandomSampler seeded
by `seed` (a SequentialSampler with no_shuffle) in batches of global_batch_size, the last partial one dropped.
"""

from __future__ import annotations

from pathlib import Path

from backends.common.data.indexed import IndexedDataset, IndexedFormatError


def field_prefix(data_path: str | Path, field: str) -> str:
    return f"{data_path}_packed_{field}_document"


def is_packed(data_path: str | Path) -> bool:
    """MindSpeed-RL's preprocessed dataset at data_path (its input_ids index is there)."""
    return Path(field_prefix(data_path, "input_ids") + ".idx").is_file()


def read_packed(data_path: str | Path, keys: list[str], max_prompt_length: int | None,
                seq_length: int | None) -> list[dict]:
    """The prompts MindSpeed-RL's PromptDataset serves, in document order: {"prompt_ids", "label_ids"}.
    Raises ValueError naming the missing or malformed file."""
    fields = {}
    for field in ("input_ids", *keys):
        prefix = field_prefix(data_path, field)
        try:
            fields[field] = IndexedDataset(prefix)
        except FileNotFoundError as err:
            why = "the prompts" if field == "input_ids" else "dataset_additional_keys lists it"
            raise ValueError(f"{err} ({why})") from None
        except IndexedFormatError as err:
            raise ValueError(str(err)) from None
    counts = {field: len(ds) for field, ds in fields.items()}
    if len(set(counts.values())) != 1:  # CombinedDataset: "Dimension is not correct !"
        raise ValueError(f"{data_path}: the fields hold different numbers of prompts ({counts})")
    lengths = fields["input_ids"].sizes
    records = []
    for i in range(len(lengths)):
        if max_prompt_length and not lengths[i] < max_prompt_length:  # _IndexReader's filter_mask
            continue
        records.append({"prompt_ids": [int(t) for t in fields["input_ids"][i][:seq_length]],
                        "label_ids": [int(t) for t in fields["labels"][i]], "data_source": ""})
    return records


def loader_rows(documents: int, samples: int, batch: int, seed: int, shuffle: bool) -> list[int]:
    """The document of each prompt MindSpeed-RL's loader yields, for `documents` train documents and
    train_iters x global_batch_size `samples`."""
    import torch

    size = -(-samples // documents) * documents  # whole passes over the documents until `samples`
    if shuffle:
        positions = torch.randperm(size, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        positions = list(range(size))
    return [p % documents for p in positions[:size - size % batch]]
