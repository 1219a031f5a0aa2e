"""The RL recipe on the shared trainer: colocated GRPO, DAPO and PPO.

One step, on every rank (each takes train_batch_size / world of the prompts, contiguously, so the
global order of the responses is the one-process order):

  rollout     n responses per prompt from the actor's own weights (rollout.generate, in place)
              (stopping at the model's EOS ids: generation_config.json and the tokenizer's, as vLLM does);
              with VeRL's rollout tensor_model_parallel_size, on the world / tp rollout replicas instead, each
              a tp-sharded copy loaded from the actor after an update (tp_rollout.py), each its share of prompts
  rewards     rewards.Scorer on the decoded responses; the score sits on the last response token
              (DAPO: groups whose rewards are all equal are dropped and more prompts are rolled out,
              up to max_gen_rounds rounds; the first train_batch_size kept groups in global order train)
  old / ref   log-probs of the responses under the actor before the update and under the frozen
              reference (kernels.linear_logprobs: no [tokens x vocab] logits)
  values      (PPO) the critic's values; KL in the reward when use_kl_in_reward
  advantages  GRPO / DAPO: group-normalised outcome advantages; PPO: GAE, whitened over the whole
              global batch (mean and variance all-reduced)
  updates     ppo_epochs passes over mini-batches of mini_batch_size prompts (in global order); each
              is one optimizer step of the actor (and the critic) through trainer.optimize, over this
              rank's micro-batches. The loss is aggregated over the whole mini-batch: every
              micro-batch carries the mini-batch's global token and sequence counts, so token-mean is
              the mean over all its tokens on all ranks (and the seq-mean modes likewise).

Layouts: replicated (every rank holds the actor; gradients averaged over the ranks after each
backward pass) or, with cfg.fsdp (VeRL's strategy fsdp / fsdp2), FSDP2 over the ranks (sharding.py:
actor, critic and reference sharded; rollout and the forward-only passes run on the gathered model;
updates in lockstep). Either way the trainer multiplies the local loss by the world size, so the
average of the gradients becomes the global sum. The MindSpeed-RL dialect's Megatron actors add tensor
parallel (a dp x tp mesh) and context parallel (a dp x cp x tp mesh, the sequences of the forward passes and
updates sharded over the cp ranks, the gradient summed over them: context_parallel.py).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn

from backends import kernels
from backends.common import kit
from backends.common.distributed import Runtime, all_reduce_sum
from backends.common.optim import build_optimizer, build_scheduler
from backends.common.trainer import Loss, Part, Recipe, Settings, StepResult, seed_everything
from backends.models import decoder

from . import (advantages, algos, batches, context_parallel, dapo_rounds, multimodal, pipeline_parallel, roles, rollout,
               sharding, tp_rollout, validation)
from .batches import Rollouts
from .config import RLConfig, RLConfigError, batch_problems
from .data import load_records, load_val_records, stop_ids
from .rewards import Scorer, load_function


def job_fields(cfg: RLConfig) -> dict[str, object]:
    """The job-file fields (dotted) the dialect's keys came from, as capabilities.LIMITS / UNBUILT name them
    (the rollout's own layout is not in RLConfig: the readers refuse what it cannot run)."""
    return {"stage": cfg.algorithm, "rl.rollout.engine": cfg.rollout_engine,
            "rl.reward.type": "function" if cfg.reward_function else cfg.verifier, "parallel.tp": cfg.tp,
            "parallel.pp": cfg.pp, "parallel.cp": cfg.cp, "rl.actor.parallel.tp": cfg.tp}


class RLRecipe(Recipe):
    name = "rl"

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.cursor = 0  # prompts consumed (the data position, resumable)
        self.steps_done = 0
        self.vision = None  # a Qwen2.5-VL model's images and positions (multimodal.Vision)

    # ------------------------------------------------------------------ build

    def build(self, rt: Runtime) -> Settings:
        from backends.rl import capabilities

        c = self.cfg
        self.rt = rt
        kit.refuse_unbuilt(capabilities, c.framework, job_fields(c), RLConfigError, "backends.rl")
        rollout.check_engine(c.rollout_engine)
        vl = multimodal.is_vl(c.model_path)  # Qwen2.5-VL: image prompts (multimodal.py)
        self._layout(rt, vl)
        broken = batch_problems(c, self.dp)  # the planner's rule (backends.contract.layout.rl_batches)
        if broken:
            raise ValueError("; ".join(f"{b.field}: {b.message} ({b.hint})" for b in broken))
        if c.expected_world is not None and c.expected_world != rt.world:
            raise ValueError(f"trainer.nnodes x n_gpus_per_node is {c.expected_world}, but {rt.world} processes run")
        if c.kernel_backend or c.kernel_overrides:
            kernels.configure(default=c.kernel_backend, overrides=c.kernel_overrides or None)
        self._data(vl)
        self._mesh(rt)  # after every check that needs no other rank
        seed_everything(c.seed)
        fn = load_function(c.reward_function) if c.reward_function else None
        self.scorer = Scorer(verifier=c.verifier, function=fn, format_weight=c.format_weight,
                             overlong_buffer=c.overlong_buffer, overlong_factor=c.overlong_factor,
                             max_response_length=c.overlong_max_length or c.max_new_tokens)
        from_pretrained = multimodal.from_pretrained if vl else decoder.from_pretrained
        actor = self._actor_and_reference(from_pretrained(c.model_path, device=rt.device), vl)
        if c.gen_batch_size and c.gen_batch_size % self.gen_dp:
            raise RLConfigError(f"data.gen_batch_size: {c.gen_batch_size} prompts do not split evenly over the "
                                f"{self.gen_dp} generating ranks or rollout replicas (each rolls out an equal share "
                                "of a round here); choose a multiple")
        self.parts = {"actor": self._part(actor, c.lr)}
        if c.algorithm == "ppo":
            self.parts["critic"] = self._part(self._critic(from_pretrained(c.model_path, device=rt.device), vl),
                                              c.critic_lr, critic=True)
        self.vllm = self._vllm_engine(rt, actor, vl) if c.rollout_engine == "vllm" else None
        self.rollout_stale = True  # the actor's weights reach the rollout engine before the first rollout (a resume
        #                            changes them)
        return Settings(total_steps=c.total_steps, save_dir=c.save_dir, save_interval=c.save_interval,
                        resume=c.resume, metrics_file=c.metrics_file, eval_only=c.val_only and c.val_before_train,
                        trackers=c.trackers)

    def validates(self) -> bool:
        return self.cfg.val_before_train or self.cfg.test_freq > 0

    def evaluate(self, trainer, step: int, start: bool = False) -> dict[str, float]:
        """VeRL's validation schedule: before the first step (val_before_train), then after every test_freq-th
        step and the last one (ray_trainer.fit)."""
        c = self.cfg
        due = c.val_before_train if start else \
            c.test_freq > 0 and (step >= trainer.settings.total_steps or step % c.test_freq == 0)
        return validation.run(self, step) if due else {}

    def _data(self, vl: bool) -> None:
        """The tokenizer, the stop ids, the prompt records (parquet rows through the chat template, or the
        dialect's own), and the step counts VeRL derives from them."""
        import transformers

        c = self.cfg
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(c.model_path)
        if not c.eos_token_id:
            c.eos_token_id = stop_ids(c.model_path, self.tokenizer)
        if c.train_files and not c.records:
            c.records = (multimodal.load_records if vl else load_records)(c, self.tokenizer)
        if not c.records:
            raise ValueError("the RL dataset has no prompts")
        if c.total_steps is None:  # VeRL: batches per epoch (the last partial one dropped) x total_epochs
            batch, key = (c.gen_batch_size, "data.gen_batch_size") if c.gen_batch_size else \
                (c.train_batch_size, "data.train_batch_size")
            per_epoch = len(c.records) // batch
            if per_epoch < 1:
                raise ValueError(f"the data set has {len(c.records)} prompts, fewer than {key} {batch}")
            c.total_steps = per_epoch * c.total_epochs
        if c.warmup_ratio and not c.warmup_steps:
            c.warmup_steps = int(c.warmup_ratio * c.total_steps)
        if c.critic_warmup_ratio and not c.critic_warmup_steps:
            c.critic_warmup_steps = int(c.critic_warmup_ratio * c.total_steps)
        if self.validates():
            if vl:
                raise RLConfigError("trainer.val_before_train / trainer.test_freq: validation of a vision-language "
                                    "actor is not built; set val_before_train false and test_freq -1")
            if c.val_files and not c.val_records:
                c.val_records = load_val_records(c, self.tokenizer)
            if not c.val_records:
                raise RLConfigError("data.val_files: validation runs (trainer.val_before_train or test_freq) but "
                                    "there are no validation prompts")
        for i, r in enumerate(c.records):
            if len(r["prompt_ids"]) > c.max_prompt_length:
                raise ValueError(f"prompt {i} has {len(r['prompt_ids'])} tokens, more than max_prompt_length "
                                 f"{c.max_prompt_length}")

    def _actor_and_reference(self, actor: nn.Module, vl: bool) -> nn.Module:
        """The actor on the layout (cp attention, tp plan, its pp stage, recompute, FSDP2), and the frozen
        reference copied from it first (on the actor's cp and pp, at ref_tp)."""
        from backends.common.parallel.recompute import apply_recompute

        c = self.cfg
        self.vision = multimodal.Vision(actor.config, c.records) if vl else None
        if vl and c.freeze_vision_tower:
            multimodal.freeze_vision(actor)
        actor.train()
        fsdp = self.fsdp
        # VeRL's rollout replicas: a copy taken before any layout (the rollout's weights follow the actor's)
        self.tp_rollout = None
        if c.rollout_tp > 1:
            self.tp_rollout = tp_rollout.TPRollout(copy.deepcopy(actor), c.rollout_tp, self.rt.world,
                                                   self.rt.device.type)
            t = self.tp_rollout
            self.gen_dp, self.gen_rank, self.gen_group = t.replicas, t.replica, t.group
        self.reference = None
        if (c.use_kl_loss and c.kl_loss_coef > 0) or c.use_kl_in_reward:
            self.reference = copy.deepcopy(actor).eval().requires_grad_(False)
            if self.cp is not None:
                context_parallel.apply(self.reference, self.cp)
            if self.tp_mesh is not None and c.ref_tp != 1:
                roles.tensor_parallel(self.reference, self.tp_mesh)
            if fsdp is not None:
                sharding.shard(self.reference, self.reference.parts(), fsdp)
            if self.pp is not None:  # the frozen reference keeps its own stage only
                pipeline_parallel.prune(self.reference, self.pp)
        if self.cp is not None:
            context_parallel.apply(actor, self.cp)
        if self.tp_mesh is not None:
            roles.tensor_parallel(actor, self.tp_mesh)
        if self.pp is not None:  # this stage's parameters trained; the rest: the rollout's gathered copy
            pipeline_parallel.own(actor, self.pp)
        if c.gradient_checkpointing:
            apply_recompute(actor.parts(), "full", fsdp=fsdp is not None)
        if fsdp is not None:
            sharding.shard(actor, actor.parts(), fsdp, c.reshard_after_forward)
        return actor

    def _critic(self, lm: nn.Module, vl: bool) -> nn.Module:
        """PPO's critic: the model with a value head, data parallel (recompute, FSDP2 as the actor's)."""
        from backends.common.parallel.recompute import apply_recompute

        c = self.cfg
        critic = (multimodal.VLCritic if vl else roles.Critic)(lm).to(self.rt.device)
        fsdp = self.fsdp
        recompute = c.critic_gradient_checkpointing
        if recompute if recompute is not None else c.gradient_checkpointing:  # (None: the actor's setting)
            apply_recompute(lm.parts(), "full", fsdp=fsdp is not None)
        if fsdp is not None:
            sharding.shard(critic, lm.parts(), fsdp, c.reshard_after_forward)
        return critic

    def _vllm_engine(self, rt: Runtime, actor: nn.Module, vl: bool):
        """rl.rollout.engine vllm: one vLLM engine per rank on its device, fed the actor's weights in memory."""
        from .vllm_rollout import CPU_HEAD_SIZES, VllmRollout

        c = self.cfg
        if rt.device.type != "cpu" and rt.world > 1:
            raise ValueError("rollout engine vllm on several accelerator ranks needs vLLM's external launcher, which "
                             "this engine does not drive yet (it is tested with vLLM's CPU build); set "
                             "rl.rollout.engine: hf")
        head_dim = (actor.config.text if vl else actor.config).head_dim
        if rt.device.type == "cpu" and head_dim not in CPU_HEAD_SIZES:
            raise ValueError(f"rollout engine vllm on the CPU: vLLM's CPU attention has no kernel for head_dim "
                             f"{head_dim} (it has {', '.join(map(str, CPU_HEAD_SIZES))}); set rl.rollout.engine: hf")
        dtype = str(next(actor.parameters()).dtype).removeprefix("torch.")
        return VllmRollout(c.model_path, dtype=dtype, max_model_len=c.max_prompt_length + c.max_new_tokens,
                           seed=c.seed, gpu_memory_utilization=c.gpu_memory_utilization,
                           enforce_eager=c.enforce_eager, images_per_prompt=self.vision.most_images() if vl else 0)

    def _layout(self, rt: Runtime, vl: bool) -> None:
        """The layout checked by the planner's rules (nothing collective yet: _mesh builds the engines' one mesh,
        pp x dp x cp x tp, tp innermost). The pp x cp x tp ranks of one dp rank hold the same samples, so
        batches, counts and loss scaling go over the dp group; the gradient all-reduce over dp x cp (the cp
        ranks' partial gradients summed). Actor and reference share it; the critic and FSDP are data parallel."""
        c = self.cfg
        self.tp, self.cp, self.pp, self.tp_mesh = c.tp, None, None, None
        if c.ref_tp not in (None, 1, c.tp):
            raise RLConfigError(f"the reference's tensor parallel size {c.ref_tp} must be 1 or the actor's {c.tp}")
        if (c.tp, c.cp, c.pp) != (1, 1, 1) and (c.fsdp or c.algorithm == "ppo"):
            raise RLConfigError("tensor / context / pipeline parallel RL actors (the MindSpeed-RL dialect's Megatron "
                                "backend) train GRPO / DAPO without FSDP; PPO's critic and FSDP are data parallel only")
        if c.pp > 1 and c.cp > 1:
            raise RLConfigError("pipeline x context parallel RL actors are not built; set the context or the "
                                "pipeline parallel size to 1")
        if c.pp > 1 and vl:
            raise RLConfigError("pipeline parallel RL actors train the text decoders; a vision-language actor runs "
                                "pp 1")
        self.shape = roles.text_shape(c.model_path)
        if c.rollout_tp > 1:
            self._check_rollout_tp(rt, vl)
        self.layout = kit.checked_layout(rt.world, RLConfigError, cp_algo=c.cp_algo, tp=c.tp, cp=c.cp, pp=c.pp,
                                         heads=self.shape.num_attention_heads, kv_heads=self.shape.num_kv_heads,
                                         layers=self.shape.num_layers)
        self.dp = self.layout.dp

    def _check_rollout_tp(self, rt: Runtime, vl: bool) -> None:
        """What a tensor-parallel rollout copy (tp_rollout.py) needs, named by the dialect's key."""
        from backends.common.parallel.tensor_parallel import TPConfigError
        from backends.models.decoder.tp_plan import check_tensor_parallel

        c = self.cfg
        key = (c.batch_fields or {}).get("rollout_tp", "rollout_tp")
        if rt.world % c.rollout_tp:
            raise RLConfigError(f"{key}: {c.rollout_tp} does not divide the {rt.world} processes (world / tp rollout "
                                "replicas of tp ranks each)")
        if vl or c.rollout_engine != "hf" or (c.tp, c.cp, c.pp) != (1, 1, 1):
            raise RLConfigError(f"{key}: {c.rollout_tp}: a tensor-parallel rollout copy is built for text decoders "
                                "with the in-repo generator and a data-parallel (FSDP) actor; set 1")
        try:
            check_tensor_parallel(self.shape, c.rollout_tp)
        except TPConfigError as err:
            raise RLConfigError(f"{key}: {c.rollout_tp}: {err}") from None

    def _mesh(self, rt: Runtime) -> None:
        """The groups of the one mesh (collective): dp for batches and counts, dp x cp for gradients, tp, the
        pipeline's and the context-parallel ones."""
        c, shape = self.cfg, self.shape
        par = self.par = kit.on_mesh(rt, self.layout, fsdp=c.fsdp, cp_algo=c.cp_algo)
        self.fsdp = par if c.fsdp and par.mesh is not None else None  # what the models shard over
        self.dp_rank, self.grad_group = par.dp_rank, par.grad_group
        self.dp_group = par.mesh["dp"].get_group() if par.mesh is not None else None
        # who rolls out which prompts: the dp ranks (the pp x cp x tp ranks of one generate the same), unless
        # VeRL's rollout replicas take over (_actor_and_reference)
        self.gen_dp, self.gen_rank, self.gen_group = self.dp, self.dp_rank, self.dp_group
        if par.mesh is None:
            return
        self.tp_mesh = par.mesh["tp"] if c.tp > 1 else None
        if c.pp > 1:  # the stages of a dp rank hold its samples (pipeline_parallel.py)
            self.pp = pipeline_parallel.setup(par.mesh, shape.num_layers, shape.tie_word_embeddings)
        if c.cp > 1:  # the cp x tp ranks of a dp rank hold its samples (context_parallel.py)
            self.cp = context_parallel.setup(par, c.cp_algo, shape.num_attention_heads)

    def _part(self, model: nn.Module, lr: float, critic: bool = False) -> Part:
        """The actor's (or the critic's: its own optimizer settings where the config gives them) optimizer,
        constant schedule after warm-up, gradient averaging and clipping."""
        c = self.cfg

        def own(value, actor_value):
            return value if critic and value is not None else actor_value

        opt = build_optimizer(model, lr=lr, weight_decay=own(c.critic_weight_decay, c.weight_decay),
                              betas=tuple(own(c.critic_betas, c.betas)))
        sched = build_scheduler(opt, lr=lr, min_lr=lr, warmup=own(c.critic_warmup_steps, c.warmup_steps),
                                total=max(c.total_steps, 1), style="constant")
        # FSDP2 reduce-scatters (averages) the gradients in each backward itself
        members = self.dp * (self.cp.size if self.cp is not None else 1)
        average = None if sharding.is_sharded(model) else roles.average_grads(model, self.dp, self.grad_group, members)
        part = Part(model, opt, sched, grad_group=self.dp_group, grad_world=self.dp, precision=c.precision,
                    grad_clip=own(c.critic_grad_clip, c.grad_clip), after_backward=average)
        if self.pp is not None:  # the actor's micro-batches through the stages; the norm over every stage
            part.forward_backward = pipeline_parallel.forward_backward(model, self.pp, self._actor_loss, c.precision)
            part.clip = pipeline_parallel.clip(model, self.pp)
        return part

    def should_stop(self) -> str | None:
        c = self.cfg
        if c.gen_batch_size and self.steps_done < c.total_steps:
            return dapo_rounds.data_left(self)
        return None

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def export(self, trainer) -> None:
        """The trained actor as a Hugging Face directory (cfg.export_hf), written by rank 0."""
        if not self.cfg.export_hf:
            return
        from backends.models.decoder import loading

        if self.vision is not None:
            return multimodal.export(self.parts["actor"].model, self.cfg.export_hf, self.cfg.model_path, self.rt.rank)
        loading.export_hf(self.parts["actor"].model, None, self.cfg.export_hf, tokenizer_dir=self.cfg.model_path,
                          base_model=self.cfg.model_path)

    def start_info(self) -> dict:
        c = self.cfg
        return {"algorithm": c.algorithm, "n": c.n, "train_batch_size": c.train_batch_size}

    # ------------------------------------------------------------------ rollout and rewards

    def _prompt_index(self, k: int) -> int:
        """The dataset row of the k-th prompt consumed (a seeded permutation per epoch when shuffling)."""
        size = len(self.cfg.records)
        if self.cfg.sample_rows is not None:  # the dialect's loader order, train_iters x its batch long
            return self.cfg.sample_rows[k]
        if self.cfg.gen_batch_size:  # the DAPO recipe's loader: batches of gen_batch_size, a last partial one dropped
            epoch, i = divmod(k, dapo_rounds.loader_rows(size, self.cfg.gen_batch_size))
        else:
            epoch, i = divmod(k, size)
        if not self.cfg.shuffle:
            return i
        seed = self.cfg.seed if self.cfg.data_seed is None else self.cfg.data_seed
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return int(torch.randperm(size, generator=g)[i])

    def _round(self, step: int, round_: int, size: int | None = None) -> Rollouts:
        """One generation round over the next `size` prompts (train_batch_size): this rank rolls out its contiguous
        share, then every rank gathers everyone's (token ids and scores only) in global prompt order."""
        c, rt = self.cfg, self.rt
        size = size or c.train_batch_size
        share = size // self.gen_dp
        first = self.cursor + self.gen_rank * share
        rows = [self._prompt_index(first + i) for i in range(share)]
        prompts = [c.records[r]["prompt_ids"] for r in rows]
        seed, ids = c.seed * 7919 + step * 131 + round_, [first + i for i in range(share)]
        out, vllm_logp = self.generate(prompts, ids, seed, rows=rows, n=c.n, temperature=c.temperature,
                                       top_p=c.top_p, top_k=c.top_k)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in out]
        truths = [c.records[r].get("ground_truth") for r in rows for _ in range(c.n)]
        sources = [c.records[r].get("data_source", "") for r in rows for _ in range(c.n)]
        if c.filter_metric:  # the DAPO recipe filters by a reward info (dapo_rounds.py)
            scores, extra, infos = self.scorer.with_infos(texts, truths, [len(r) for r in out], sources)
            extra["filter_metric"] = dapo_rounds.metric_values(infos, c.filter_metric)
        else:
            scores, extra = self.scorer(texts, truths, [len(r) for r in out], sources)
        extra["record"] = [r for r in rows for _ in range(c.n)]  # each response's record (its images, its answer)
        if self.vllm is not None:  # vLLM's log-probability of each sampled token, checked against the actor's
            extra["rollout_logp"] = vllm_logp
        mine = Rollouts.pack([p for p in prompts for _ in range(c.n)], out, scores,
                             [first + i for i in range(share) for _ in range(c.n)], extra, rt.device)
        self.cursor += size
        if self.gen_dp == 1:  # one process, or the ranks that generated the same (pp x cp x tp, a rollout replica)
            return mine
        # the generating ranks' shares, from the peers at this rank's coordinate within them (they generated the same)
        return mine.gather(self.gen_group)

    def generate(self, prompts: list[list[int]], ids: list[int], seed: int, *, rows: list[int] | None, n: int,
                 temperature: float, top_p: float, top_k: int) -> tuple[list[list[int]], object]:
        """n responses per prompt from the actor's current weights (the rollout engine of the config; each sample
        on its own stream seeded by (seed, its id in `ids`, its number)) -> (responses, vLLM's log-probs or None).
        `rows`: the records' indices, for a vision-language actor's images."""
        c = self.cfg
        actor, vllm_logp = self.parts["actor"].model, None
        with sharding.gathered(actor):  # ranks stop generating at different steps: no per-block gathers
            if self.tp_rollout is not None and self.rollout_stale:  # every rank takes part
                self.tp_rollout.load(actor)
                self.rollout_stale = False
            if self.vllm is not None:
                if self.rollout_stale:  # every rank of the layout takes part (tensor parallel shards made whole)
                    self.vllm.load(actor)
                    self.rollout_stale = False
                inputs = self.vision.engine_prompts(rows) if self.vision else prompts
                out, vllm_logp = self.vllm.generate(inputs, max_new_tokens=c.max_new_tokens, temperature=temperature,
                                                    top_p=top_p, top_k=top_k, n=n, eos_token_id=c.eos_token_id or None,
                                                    seed=seed, stop=c.stop or None, prompt_ids=ids)
            else:
                model = actor if self.tp_rollout is None else self.tp_rollout.model
                out = rollout.generate(model, prompts, max_new_tokens=c.max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k, n=n, eos_token_id=c.eos_token_id or None,
                                       seed=seed, stop=c.stop or None,
                                       decode=self.tokenizer.decode if c.stop else None, prompt_ids=ids,
                                       vision=self.vision.prompts(rows) if self.vision else None)
        return out, vllm_logp

    def _collect(self, step: int) -> tuple[Rollouts, dict]:
        """Roll out (DAPO: several rounds, keeping the groups whose rewards differ, the first
        train_batch_size of them in global order) -> (the global batch, the same on every rank, with
        group indices 0.., metrics)."""
        c = self.cfg
        if c.gen_batch_size is not None:  # the run is VeRL's DAPO recipe
            return dapo_rounds.collect(self, step)
        parts, scores, rounds, groups = [], [], 0, 0
        while True:
            r = self._round(step, rounds)
            rounds += 1
            scores.append(r.scores)
            by_group = r.scores.view(-1, c.n)
            keep = torch.ones(by_group.shape[0], dtype=torch.bool, device=by_group.device)
            if c.filter_groups:
                keep &= by_group.amax(1) != by_group.amin(1)
            keep &= keep.cumsum(0) <= c.train_batch_size - groups  # the first ones that fill the batch
            parts.append(r.select(keep.repeat_interleave(c.n)).with_groups(groups, c.n))
            groups += int(keep.sum())
            if not c.filter_groups or groups >= c.train_batch_size or (c.max_gen_rounds and rounds >= c.max_gen_rounds):
                break
        kept = Rollouts.cat(parts)
        return kept, batches.step_metrics(kept, scores, rounds, groups)

    # ------------------------------------------------------------------ forward passes

    def _chunks(self, r: Rollouts, rows: list[int], size: int | None = None, budget: int | None = None
                ) -> list[list[int]]:
        """The rows in micro-batches: of `size` responses (the micro_batch_size), or with a token budget
        (VeRL's use_dynamic_bsz) by token_micro_batches over the prompt + response lengths."""
        if budget is not None:
            index = torch.tensor(rows, dtype=torch.long, device=r.responses.device)
            seqlens = (r.prompt_lens[index] + r.response_lens[index]).tolist()
            return [[rows[i] for i in part] for part in token_micro_batches(seqlens, budget)]
        size = size or self.cfg.micro_batch_size
        return [rows[s:s + size] for s in range(0, len(rows), size)]

    def _micro(self, r: Rollouts, rows: list[int], size: int | None = None, budget: int | None = None) -> list[dict]:
        return [batches.micro_batch(r, chunk, self.vision) for chunk in self._chunks(r, rows, size, budget)]

    def _critic_micro(self, r: Rollouts, mine: list[int], micro: list[dict], tokens: float, seqs: float) -> list[dict]:
        """The critic's update micro-batches: critic_micro_batch_size responses each (VeRL's
        critic.ppo_micro_batch_size_per_gpu; the actor's micro-batches when unset or equal), a last shorter
        one where the rank's share does not divide, with the mini-batch's global counts (the loss is the
        same whatever the split). The values pass runs on the log-prob micro-batches."""
        c = self.cfg
        size, budget = c.critic_micro_batch_size, c.critic_max_token_len if c.critic_dynamic_bsz else None
        if budget is None and (size is None or size == c.micro_batch_size):
            return micro
        out = self._micro(r, mine, size, budget)
        if sharding.is_sharded(self.parts["critic"].model):  # every rank the same passes
            out = sharding.lockstep(out, self.rt.device)
        for m in out:
            m["global_tokens"], m["global_seqs"] = tokens, seqs
        return out

    def _logprobs(self, model, mb: dict, entropy: bool = False):
        if self.cp is not None:  # the sequences sharded over the cp ranks
            return context_parallel.logprobs(model, mb, self.cp, temperature=self.cfg.temperature or 1.0,
                                             entropy=entropy)
        if "hidden" in mb:  # pipeline parallel: the last stage's hidden states (pipeline_parallel.py)
            hidden = mb["hidden"]
        else:
            hidden = model(mb["input_ids"], return_hidden=True, **mb.get("vision", {}))
        mask = mb["mask"]
        weight, t = model.output_weight(), self.cfg.temperature or 1.0
        if hasattr(hidden, "to_local"):  # TP: replicated hidden states, the head sharded by vocabulary rows
            hidden = hidden.to_local()
        picked = hidden.gather(1, mb["pred"][..., None].expand(-1, -1, hidden.shape[-1]))[mask]
        if hasattr(weight, "device_mesh"):  # a TP model (a reference at ref_tp 1 is a plain replica)
            logp, ent = kernels.vocab_parallel_logprobs(picked, weight, mb["responses"][mask],
                                                        self.tp_mesh.get_group(), temperature=t)
        else:
            logp, ent = kernels.linear_logprobs(picked, weight, mb["responses"][mask], temperature=t)
        full = torch.zeros(mask.shape, dtype=logp.dtype, device=logp.device).masked_scatter(mask, logp)
        if not entropy:
            return full, None
        return full, torch.zeros(mask.shape, dtype=ent.dtype, device=ent.device).masked_scatter(mask, ent)

    def _values(self, critic, mb: dict) -> torch.Tensor:
        return critic(mb["input_ids"], **mb.get("vision", {})).gather(1, mb["pred"]) * mb["mask"]

    # ------------------------------------------------------------------ the step

    def step(self, trainer, step: int) -> StepResult:
        t0 = time.perf_counter()
        r, metrics = self._collect(step)
        self.steps_done = step + 1
        if self.cfg.rollout_dump_dir and self.rt.is_main:
            self._dump_rollouts(r, step + 1)  # VeRL's global_steps: 1 in the first step
        t_rollout = time.perf_counter() - t0
        minis = [batches.share(rows, self.dp, self.dp_rank)
                 for rows in batches.mini_batches(r.groups.tolist(), self.cfg.mini_batch_size, self.dp)]
        mine = [row for mini in minis for row in mini]
        actor = self.parts["actor"].model
        critic = self.parts["critic"].model if "critic" in self.parts else None
        t1 = time.perf_counter()
        c = self.cfg
        # each pass's micro-batches: micro_batch_size responses, or its token budget (log_prob_use_dynamic_bsz)
        passes = [("old_logp", actor, lambda m, mb: self._logprobs(m, mb)[0],
                   c.logprob_max_token_len if c.logprob_dynamic_bsz else None)]
        if self.reference is not None:
            passes.append(("ref_logp", self.reference, lambda m, mb: self._logprobs(m, mb)[0],
                           c.ref_max_token_len if c.ref_dynamic_bsz else None))
        if critic is not None:
            passes.append(("values", critic, self._values,
                           c.critic_forward_max_token_len if c.critic_dynamic_bsz else None))
        split: dict = {}
        with torch.no_grad():
            for key, model, forward, budget in passes:  # one model gathered at a time (sharded: see sharding.py)
                if budget not in split:
                    chunks = self._chunks(r, mine, budget=budget)
                    split[budget] = chunks, [batches.micro_batch(r, chunk, self.vision) for chunk in chunks]
                chunks, stacked = split[budget]
                with sharding.gathered(model):
                    if self.pp is not None:  # through the stages; the last stage's results broadcast over pp
                        values = pipeline_parallel.forward(model, stacked, self.pp,
                                                           lambda h, mb, m=model, f=forward: f(m, {**mb, "hidden": h}))
                    else:
                        values = [forward(model, mb) for mb in stacked]
                # this rank's rows filled in, the others stay 0
                out = torch.zeros(r.responses.shape, dtype=values[0].dtype if values else torch.float32,
                                  device=r.responses.device)
                for chunk, value in zip(chunks, values):
                    out[torch.tensor(chunk, device=out.device), :value.shape[1]] = value.to(out.device)
                r.extra[key] = out
        t_ref = time.perf_counter() - t1
        if self.vllm is not None:
            metrics.update(self._rollout_probs_diff(r, mine))
        self._advantages(r, mine)
        t2 = time.perf_counter()
        result = self._update(trainer, r, minis, step)
        if self.pp is not None:  # the rollout's whole model: the other stages' updated weights, in memory
            pipeline_parallel.refresh(actor, self.pp)
        self.rollout_stale = True
        t_update = time.perf_counter() - t2
        result.metrics.update(metrics)
        result.metrics.update({"time_rollout_s": t_rollout, "time_reference_s": t_ref, "time_update_s": t_update})
        result.seconds = time.perf_counter() - t0
        return result

    def _dump_rollouts(self, r: Rollouts, step: int) -> None:
        """trainer.rollout_data_dir: the step's training batch as VeRL's _log_rollout_data writes it, one line per
        response (input, output, gts, score: its reward, step, uid: "<data row>_<sample>_0", VeRL's
        {uid}_{session}_{index} key with the prompt's row in the data set for VeRL's random uuid)."""
        decode = lambda ids, n: self.tokenizer.decode(ids[:n].tolist(), skip_special_tokens=True)  # noqa: E731
        rows = []
        for i in range(len(r)):
            row = int(r.extra["record"][i])
            record = self.cfg.records[row]
            rows.append({"input": decode(r.prompts[i], int(r.prompt_lens[i])),
                         "output": decode(r.responses[i], int(r.response_lens[i])),
                         "gts": record.get("ground_truth"), "score": float(r.scores[i]), "step": step,
                         "uid": f"{row}_{i % self.cfg.n}_0"})
        validation.write_generations(self.cfg.rollout_dump_dir, step, rows)

    def _rollout_probs_diff(self, r: Rollouts, mine: list[int]) -> dict:
        """|p_vLLM - p_actor| of the sampled tokens over the batch (VeRL's training/rollout_probs_diff_*): the
        rollout engine and the actor hold the same weights when it is at float noise. Also the largest
        |log p_vLLM - log p_actor| (training/rollout_logprob_diff_max): where the model spreads its probability
        thin, as a barely trained one does, a stale weight shows there long before it moves the probabilities."""
        index = torch.tensor(mine, dtype=torch.long, device=r.responses.device)
        mask = r.response_mask(index)
        engine, actor = r.extra["rollout_logp"][index][mask], r.extra["old_logp"][index].float()[mask]
        probs, logs = (engine.exp() - actor.exp()).abs(), (engine - actor).abs()
        stats = all_reduce_sum(torch.stack([probs.double().sum(), torch.tensor(float(probs.numel()),
                                            dtype=torch.float64, device=index.device)]), self.dp_group).tolist()
        peak = torch.stack([x.max() if x.numel() else x.new_zeros(()) for x in (probs, logs)])
        if self.dp > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.dp_group)
        return {"training/rollout_probs_diff_max": float(peak[0]), "training/rollout_probs_diff_mean":
                stats[0] / max(stats[1], 1.0), "training/rollout_logprob_diff_max": float(peak[1])}

    def _advantages(self, r: Rollouts, mine: list[int]) -> None:
        advantages.compute(r, mine, self.cfg, self.dp_group, kl_in_reward=self.reference is not None)

    def _update(self, trainer, r: Rollouts, minis: list[list[int]], step: int) -> StepResult:
        c, rt = self.cfg, self.rt
        results, critic_results, count, critic_count = [], [], 0, 0
        for _epoch in range(c.ppo_epochs):
            for mine in minis:
                micro = self._micro(r, mine, budget=c.max_token_len if c.dynamic_bsz else None)
                count += len(micro)
                if sharding.is_sharded(self.parts["actor"].model):  # every rank the same passes
                    micro = sharding.lockstep(micro, rt.device)
                counts = torch.tensor([sum(m["n_tokens"] for m in micro), float(len(mine))], dtype=torch.float64,
                                      device=rt.device)
                tokens, seqs = all_reduce_sum(counts, self.dp_group).tolist()
                for m in micro:
                    m["global_tokens"], m["global_seqs"] = tokens, seqs
                if "critic" in self.parts:
                    critic_micro = self._critic_micro(r, mine, micro, tokens, seqs)
                    critic_count += len(critic_micro)
                    critic_results.append(trainer.optimize(self.parts["critic"], critic_micro, self._critic_loss))
                if "critic" not in self.parts or step >= c.critic_warmup:
                    results.append(trainer.optimize(self.parts["actor"], micro, self._actor_loss))
        merged = _merge(results, critic_results)
        merged.metrics["update_micro_batches"] = float(count)  # this rank's (by size or token budget)
        if critic_results:
            merged.metrics["critic/update_micro_batches"] = float(critic_count)
        return merged

    def _actor_loss(self, model, mb: dict) -> Loss:
        c = self.cfg
        if mb.get("padding"):
            hidden = model(mb["input_ids"], return_hidden=True, **mb.get("vision", {}))
            return Loss(sum=sharding.zero_touch(hidden, model.output_weight()), weight=0.0)
        mask = mb["mask"].float()
        agg = {"global_tokens": mb["global_tokens"], "global_seqs": mb["global_seqs"]}
        logp, ent = self._logprobs(model, mb, entropy=True)
        loss, m = algos.policy_loss(mb["old_logp"], logp, mb["advantages"], mask, c.clip_low, c.clip_high, c.clip_c,
                                    c.loss_agg_mode, **agg)
        metrics = {f"actor/{k}": float(v) for k, v in m.items()}
        entropy = algos.agg_loss(ent, mask, c.loss_agg_mode, **agg)
        metrics["actor/entropy"] = float(algos.masked_mean(ent.detach(), mask))
        if c.entropy_coeff:
            loss = loss - c.entropy_coeff * entropy
        if c.use_kl_loss and self.reference is not None and c.kl_loss_coef > 0:
            kl = algos.kl_penalty(logp, mb["ref_logp"], c.kl_loss_type)
            loss = loss + c.kl_loss_coef * algos.agg_loss(kl, mask, c.loss_agg_mode, **agg)
            metrics["actor/kl_loss"] = float(algos.masked_mean(kl.detach(), mask))
        # normalised over the whole mini-batch already (agg_loss with its global counts); metrics token-weighted
        return Loss(mean=loss, metrics=metrics, weight=mb["n_tokens"])

    def _critic_loss(self, model, mb: dict) -> Loss:
        c = self.cfg
        if mb.get("padding"):
            return Loss(sum=sharding.zero_touch(model(mb["input_ids"], **mb.get("vision", {}))), weight=0.0)
        agg = {"global_tokens": mb["global_tokens"], "global_seqs": mb["global_seqs"]}
        vpreds = self._values(model, mb)
        loss, clipfrac = algos.value_loss(vpreds, mb["returns"], mb["values"], mb["mask"].float(), c.cliprange_value,
                                          c.loss_agg_mode, **agg)
        return Loss(mean=loss, metrics={"critic/vf_clipfrac": float(clipfrac)}, weight=mb["n_tokens"])


# ---------------------------------------------------------------------- VeRL's dynamic batch sizes


def _karmarkar_karp(loads: list[int], k: int) -> list[list[int]]:
    """VeRL's karmarkar_karp (equal_size false): the largest differencing method over k sets, ties broken as
    VeRL breaks them (so the partitions are VeRL's)."""
    import heapq

    class Part:
        def __init__(self):
            self.sum, self.items = 0, []

        def add(self, idx, val):
            self.items.append((idx, val))
            self.sum += val

        def __lt__(self, other):
            if self.sum != other.sum:
                return self.sum < other.sum
            if len(self.items) != len(other.items):
                return len(self.items) < len(other.items)
            return self.items < other.items

    class State:
        def __init__(self, idx, val):
            self.sets = [Part() for _ in range(k)]
            self.sets[0].add(idx, val)
            self.sets.sort(reverse=True)

        def merge(self, other):
            for i in range(k):
                for idx, val in other.sets[k - 1 - i].items:
                    self.sets[i].add(idx, val)
            self.sets.sort(reverse=True)

        def spread(self):
            return self.sets[0].sum - self.sets[-1].sum

        def __lt__(self, other):  # the largest spread pops first, then the largest set
            if self.spread() != other.spread():
                return self.spread() > other.spread()
            return self.sets[0] > other.sets[0]

    heap: list = []
    for val, idx in sorted((val, i) for i, val in enumerate(loads)):
        heapq.heappush(heap, State(idx, val))
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [[idx for idx, _ in part.items] for part in heap[0].sets]


def token_micro_batches(seqlens: list[int], max_token_len: int) -> list[list[int]]:
    """VeRL's rearrange_micro_batches (one rank, workload balance on): the fewest micro-batches of at most
    max_token_len tokens, from ceil(total / max_token_len) up, balanced by VeRL's attention-workload estimate
    (get_seqlen_balanced_partitions), heaviest first then interleaved from both ends -> indices into seqlens."""
    if not seqlens:
        return []
    if max(seqlens) > max_token_len:
        raise ValueError(f"a sequence of {max(seqlens)} tokens is longer than the micro-batch token budget "
                         f"{max_token_len} (ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu)")
    workloads = [24576 * n + n * n for n in seqlens]
    count = min(len(seqlens), -(-sum(seqlens) // max_token_len))
    while True:
        parts = [sorted(p) for p in _karmarkar_karp(workloads, count)]
        if all(sum(seqlens[i] for i in p) <= max_token_len for p in parts):
            break
        count += 1
    parts.sort(key=lambda p: (sum(workloads[i] for i in p), p[0]), reverse=True)
    return parts[::2][::-1] + parts[1::2]


def _merge(actor: list[StepResult], critic: list[StepResult]) -> StepResult:
    """One StepResult for the step: the actor's mean loss and last grad norm, summed tokens, mean metrics."""
    if not actor and not critic:
        return StepResult(loss=0.0, grad_norm=0.0, tokens=0, valid_tokens=0, seconds=0.0)
    main = actor or critic
    metrics: dict[str, float] = {}
    for res in actor + critic:
        for k, v in res.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v / (len(actor) if k.startswith("actor/") else len(critic))
    if critic:
        metrics["critic/vf_loss"] = sum(x.loss for x in critic) / len(critic)
        metrics["critic/grad_norm"] = critic[-1].grad_norm
    return StepResult(loss=sum(x.loss for x in main) / len(main), grad_norm=main[-1].grad_norm,
                      tokens=sum(x.tokens for x in main), valid_tokens=sum(x.valid_tokens for x in main),
                      seconds=sum(x.seconds for x in main), real_tokens=sum(x.real_tokens for x in main),
                      metrics=metrics)


def main(argv: list[str] | None = None) -> int:
    """`python -m backends.rl [<file>.yaml] [key=value ...]` (a VeRL ppo_trainer tree or a MindSpeed-RL file; no
    file: VeRL's ppo_trainer default and the overrides)."""
    from backends.common import trainer

    from .dialects import from_argv
    from .rewards import RewardError

    def make(args: list[str]) -> RLRecipe:
        return RLRecipe(from_argv(args))

    return trainer.main("backends.rl", make, argv, user_errors=(RLConfigError, RewardError))
