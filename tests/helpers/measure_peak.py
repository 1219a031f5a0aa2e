"""Measure the peak memory of real training steps of a transformers model on the CPU.

Run as a fresh process with MALLOC_MMAP_THRESHOLD_ set low, so every large tensor is its own
mapping and freed memory goes back to the OS at once: peak RSS then tracks the peak of live
tensors. Prints JSON {"peak_bytes": …, "params": …} (peak above the RSS before the model exists).
"""

import json
import resource
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def main(cfg_json: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads(cfg_json)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = rss_bytes()
    config = Qwen3Config(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["ffn_hidden_size"],
        num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"], tie_word_embeddings=False,
        max_position_embeddings=cfg["seq_len"], attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ids = torch.randint(0, cfg["vocab_size"], (cfg["micro_batch"], cfg["seq_len"]))
    for _ in range(2):  # the second step has the optimizer states allocated
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_bytes": peak - base, "params": sum(p.numel() for p in model.parameters())}))


if __name__ == "__main__":
    main(sys.argv[1])
