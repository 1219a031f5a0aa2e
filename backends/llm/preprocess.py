"""`python -m backends.llm.preprocess`: MindSpeed-LLM's preprocess_data.py step.

Two forms:
- preprocess_data.py's own flags (`--input --tokenizer-name-or-path --output-prefix --handler-name …`,
  types as upstream declares them): writes MindSpeed-LLM's files at --output-prefix
  (backends.common.data.megatron says which); training then takes `--data-path <prefix>` for
  instruction data, `--data-path <prefix>_text_document` for pre-training data.
- the engine's training flags (`--data-path … --seq-length …`, what `ascendfactory preprocess` passes):
  tokenizes into the run's cache, as training would.
Both print one JSON object a line on stdout ({"progress": done, "total": n}, then
{"event": "preprocessed", …}) for `ascendfactory preprocess`'s progress bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from backends.common.megatron_args import Parser
from backends.llm.config import HANDLER_FORMATS, PROMPT_TYPE_TEMPLATES, ConfigError, parse_args, prompt_template

# the handlers whose records this engine trains on (pairwise data: llamafactory's dpo)
HANDLERS = {name: fmt for name, fmt in HANDLER_FORMATS.items() if fmt != "pairwise"}
PROMPT_TYPES = ("default", "empty", "trl", "chatglm2", "chatglm3", "chatglm3_system", "glm4", "glm4_moe", "chatml",
                "bailing_mini", "chatml_de", "qwen", "qwen_r1", "qwen_math_r1", "llama3", "llama2", "mistral",
                "mixtral", "gemma", "alpaca", "deepseek2", "deepseek2-lite", "cpm", "baichuan2", "deepseek3",
                "intern2", "hunyuan", "qwen3", "magistral", "plm", "qwen_lf", "gpt_oss", "deepseek4")


def _bool(values: dict):
    return lambda text: values[text.lower()]


def upstream_parser() -> Parser:
    """preprocess_data.py's flags, with upstream's types, choices and defaults."""
    p = Parser("python -m backends.llm.preprocess", ConfigError)
    a = p.add_argument
    a("--input", required=True)
    a("--handler-name", default="")
    a("--streaming", action="store_true")
    a("--hf-datasets-params")
    a("--datasets", nargs="+")
    a("--json-keys", nargs="+", default=["text"])
    a("--split-sentences", action="store_true")
    a("--keep-newlines", action="store_true")
    a("--prompt-type", choices=PROMPT_TYPES)
    a("--prompt-type-path")
    a("--dataset-additional-keys", nargs="*", default=[])
    a("--interleave-probs")
    a("--mix-strategy", choices=["concat", "interleave_under", "interleave_over"], default="concat")
    a("--dataset-dir")
    a("--overwrite-cache", action="store_true")
    a("--max-samples", type=int)
    a("--seed", type=int, default=1234)
    a("--cache-dir", default="~/tmp")
    a("--map-keys", type=json.loads)
    a("--pack", action="store_true")
    a("--neat-pack", action="store_true")
    a("--script-data-dir")
    a("--enable-thinking", type=_bool({"true": True, "false": False, "none": None}))
    a("--pad-to-multiple-of", type=int, default=1)
    a("--data-obfuscation", action="store_true")
    a("--obf-seed-content")
    a("--reasoning-effort", choices=["max", "high"])
    a("--drop-thinking", type=_bool({"true": True, "false": False}), default=True)
    a("--tokenizer-type", default="PretrainedFromHF", choices=["BertWordPieceLowerCase", "BertWordPieceCase",
      "GPT2BPETokenizer", "GPTSentencePieceTokenizer", "PretrainedFromHF", "MagistralTokenizer"])
    a("--tokenizer-not-use-fast", action="store_false", dest="tokenizer_use_fast")
    a("--vocab-file")
    a("--merge-file")
    a("--append-eod", action="store_true")
    a("--tokenizer-name-or-path")
    a("--tokenizer-model")
    a("--seq-length", type=int)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--pad-vocab-size-to", type=int)
    a("--reward-tokens", nargs="+", default=[])
    a("--output-prefix", required=True)
    a("--dataset-impl", choices=["lazy", "cached", "mmap"], default="mmap")
    a("--workers", type=int, default=1)
    a("--n-subs", type=int, default=1)
    a("--log-interval", type=int, default=100)
    a("--merge-group-keys", nargs="+")
    return p


def refusals(ns: argparse.Namespace) -> list[str]:
    """What this build of preprocess_data.py does not do, each with its flag and what to use instead."""
    out = []
    handler = ns.handler_name or "GeneralPretrainHandler"
    if handler not in HANDLERS:
        out.append(f"--handler-name {handler}: not built; this engine prepares {', '.join(HANDLERS)}"
                   + (" (preference pairs: framework llamafactory, stage dpo)" if "Pairwise" in handler else ""))
    if HANDLERS.get(handler) in ("alpaca", "sharegpt"):
        if ns.prompt_type is None:
            out.append("--prompt-type: instruction handlers need it (MindSpeed-LLM asks the same); "
                       f"this build has {', '.join(_prompt_types())}")
        elif PROMPT_TYPE_TEMPLATES.get(ns.prompt_type, ns.prompt_type) not in _templates():
            out.append(f"--prompt-type {ns.prompt_type}: no chat template of that name in this build; use one of "
                       f"{', '.join(_prompt_types())}")
    if ns.tokenizer_type != "PretrainedFromHF":
        out.append(f"--tokenizer-type {ns.tokenizer_type}: only PretrainedFromHF (a Hugging Face tokenizer folder "
                   f"given by --tokenizer-name-or-path) is built")
    if not ns.tokenizer_name_or_path:
        out.append("--tokenizer-name-or-path: give the Hugging Face model or tokenizer folder")
    for flag, value in (("--vocab-file", ns.vocab_file), ("--merge-file", ns.merge_file),
                        ("--tokenizer-model", ns.tokenizer_model)):
        if value:
            out.append(f"{flag}: only Hugging Face tokenizer folders are read; use --tokenizer-name-or-path")
    unbuilt = {"--streaming": ns.streaming, "--hf-datasets-params": ns.hf_datasets_params,
               "--datasets": ns.datasets, "--merge-group-keys": ns.merge_group_keys,
               "--split-sentences": ns.split_sentences, "--prompt-type-path": ns.prompt_type_path,
               "--dataset-additional-keys": ns.dataset_additional_keys, "--interleave-probs": ns.interleave_probs,
               "--dataset-dir": ns.dataset_dir, "--map-keys": ns.map_keys, "--script-data-dir": ns.script_data_dir,
               "--data-obfuscation": ns.data_obfuscation, "--obf-seed-content": ns.obf_seed_content,
               "--reasoning-effort": ns.reasoning_effort, "--reward-tokens": ns.reward_tokens}
    for flag, value in unbuilt.items():
        if value:
            out.append(f"{flag}: not built; give one local json/jsonl/parquet file or folder as --input, with "
                       f"the column names the handler expects")
    if ns.mix_strategy != "concat":
        out.append(f"--mix-strategy {ns.mix_strategy}: mixing datasets is not built; use concat")
    if ns.dataset_impl != "mmap":
        out.append(f"--dataset-impl {ns.dataset_impl}: only mmap (Megatron's MMIDIDX .bin/.idx) is written")
    if ns.pad_to_multiple_of != 1:
        out.append(f"--pad-to-multiple-of {ns.pad_to_multiple_of}: padding samples on disk is not built; pad at "
                   f"training time (--pad-to-multiple-of with --no-pad-to-seq-lengths)")
    if not ns.drop_thinking:
        out.append("--drop-thinking false: keeping earlier turns' reasoning is not built; leave it true")
    if (ns.pack or ns.neat_pack) and HANDLERS.get(handler) == "text":
        out.append("--pack: pre-training data is not packed (MindSpeed-LLM refuses it too); drop --pack")
    if ns.neat_pack and not ns.pack:
        out.append("--neat-pack: needs --pack (it numbers the documents of packed rows)")
    if ns.pack and not ns.seq_length:
        out.append("--pack: needs --seq-length (the length of a packed row)")
    return out


def _templates():
    from backends.common.data import TEMPLATES

    return TEMPLATES


def _prompt_types() -> list[str]:
    """The --prompt-type values this build encodes (templates MindSpeed-LLM has no prompt type for, as
    gemma3 and qwen2_vl, are left out: its parser refuses them)."""
    back = {v: k for k, v in PROMPT_TYPE_TEMPLATES.items()}
    return sorted(p for p in (back.get(name, name) for name in _templates()) if p in PROMPT_TYPES)


def run_upstream(argv: list[str]) -> int:
    from backends.common.data import load_tokenizer, megatron

    try:
        ns = upstream_parser().parse_args(argv)
        refused = refusals(ns)
        if refused:
            raise ConfigError("this build does not implement: " + "; ".join(refused))
        megatron.check_output_prefix(ns.output_prefix)
        handler = ns.handler_name or "GeneralPretrainHandler"
        fmt = HANDLERS[handler]
        tokenizer = load_tokenizer(ns.tokenizer_name_or_path, use_fast=ns.tokenizer_use_fast)
        opt = megatron.WriteOptions(seq_length=ns.seq_length, pack=ns.pack, neat_pack=ns.neat_pack,
                                    append_eod=ns.append_eod, json_keys=tuple(ns.json_keys),
                                    max_samples=ns.max_samples, log_interval=ns.log_interval,
                                    progress=lambda done, total: print(json.dumps({"progress": done, "total": total}),
                                                                       flush=True))
        if fmt == "text":
            stats = megatron.write_pretrain(ns.input, tokenizer, ns.output_prefix, opt)
            kind = "text"
        else:
            name = PROMPT_TYPE_TEMPLATES.get(ns.prompt_type, ns.prompt_type)
            template = prompt_template(name, tokenizer, ns.enable_thinking)
            stats = megatron.write_instruction(ns.input, fmt, tokenizer, template, ns.output_prefix, opt)
            kind = "instruction"
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"backends.llm.preprocess: error: {err}", file=sys.stderr)
        return 2
    files = megatron.output_files(ns.output_prefix, kind, ns.json_keys)
    data_path = ns.output_prefix if kind == "instruction" else files[0]
    print(json.dumps({"event": "preprocessed", "path": data_path, "files": files, "samples": stats["samples"],
                      "tokens": stats["tokens"], "truncated": stats.get("truncated", 0), "reused": False,
                      "summary": f"{kind} dataset {data_path}: {json.dumps(stats)}"}), flush=True)
    return 0


def run_engine_form(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # preprocess_data.py always names --output-prefix; the training flags never do
    if "--output-prefix" in argv or not any(a == "--data-path" or a.startswith("--data-path=") for a in argv):
        return run_upstream(argv)
    return run_engine_form(argv)


if __name__ == "__main__":
    sys.exit(main())
