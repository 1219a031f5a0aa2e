"""A reference record encoded by our data code, keyed as LLaMA-Factory's processors key their output (the LF
template fixtures of tests/lf compare the two)."""

from __future__ import annotations

from backends.common.data import formats


def encode_record(rec: dict, args: dict, tok, template, where) -> dict:
    """rec: a fixture record ({"ranking", "formatting", "record"}); args: the case's data arguments."""
    if rec["ranking"]:
        chosen, rejected = formats.encode_pairwise(tok, template, rec["record"], where, 0,
                                                   cutoff_len=args["cutoff_len"])
        return {"chosen_input_ids": chosen.input_ids, "chosen_labels": chosen.labels,
                "rejected_input_ids": rejected.input_ids, "rejected_labels": rejected.labels}
    sample = formats.encode_instruction(tok, template, rec["formatting"], rec["record"], where, 0,
                                        train_on_prompt=bool(args.get("train_on_prompt")),
                                        mask_history=bool(args.get("mask_history")), cutoff_len=args["cutoff_len"])
    return {"input_ids": sample.input_ids, "labels": sample.labels}
