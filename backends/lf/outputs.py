"""What transformers' Trainer leaves in LLaMA-Factory's output_dir beside trainer_log.jsonl: trainer_state.json
(TrainerState.save_to_json, its log_history one entry per logged step and the closing metrics),
train_results.json and all_results.json (Trainer.save_metrics("train", ...): runtime, samples and steps per
second, total_flos, train_loss, epoch).

The numbers follow the Trainer: a logged loss is the mean of the steps since the last log; the epoch counts the
micro-batches taken; train_loss the mean over this session's steps; total_flos 6 x the parameters outside the embeddings x every input position on every
rank (PreTrainedModel.floating_point_ops, padding included); samples per second count the schedule's samples
(max_steps x the global batch) over the wall time of the session's steps."""

from __future__ import annotations

import json
import time
from pathlib import Path


class TrainerOutputs:
    def __init__(self, output_dir: str | Path, *, max_steps: int, batches_per_epoch: int, accumulation: int,
                 logging_steps: int, save_steps: int, micro_batch: int, num_train_epochs: float, flops_params: int,
                 global_batch: int, count_tokens: str = "no"):
        self.dir = Path(output_dir)
        self.max_steps, self.batches, self.accumulation = max_steps, max(batches_per_epoch, 1), accumulation
        self.per_epoch = -(-self.batches // accumulation)
        self.logging_steps, self.save_steps, self.micro_batch = logging_steps, save_steps, micro_batch
        self.num_train_epochs, self.flops_params, self.global_batch = num_train_epochs, flops_params, global_batch
        self.count_tokens = count_tokens  # include_num_input_tokens_seen: all | non_padding | no
        self.tokens_seen = 0                # TrainerState.num_input_tokens_seen
        self._session_tokens = 0
        self.log_history: list[dict] = []
        self.total_flos = 0.0
        self._interval: list[float] = []
        self._losses: list[float] = []
        self._start: float | None = None
        self._first_step: int | None = None

    def epoch(self, step: int) -> float:
        """The Trainer's state.epoch after optimizer step `step`: the epoch plus the share of its micro-batches
        taken (epoch + (micro-batch index + 1) / micro-batches per epoch, not a count of optimizer steps)."""
        epoch, into = divmod(step - 1, self.per_epoch)
        return epoch + min((into + 1) * self.accumulation, self.batches) / self.batches

    def stepped(self, step: int, loss: float, tokens: int, real_tokens: int = 0) -> None:
        """After every optimizer step (`step` counted from 1); tokens: the input positions of every rank's
        micro-batches, real_tokens those that are not padding."""
        if self._start is None:
            self._start, self._first_step = time.time(), step - 1
        self._interval.append(loss)
        self._losses.append(loss)
        self.total_flos += 6.0 * self.flops_params * tokens
        if self.count_tokens != "no":
            seen = tokens if self.count_tokens == "all" else real_tokens
            self.tokens_seen += seen
            self._session_tokens += seen

    def _tokens(self, speed: bool) -> dict:
        """What Trainer.log adds when it counts input tokens; speed: a training log's runtime and token rate."""
        if self.count_tokens == "no":
            return {}
        out = {"num_input_tokens_seen": self.tokens_seen}
        if speed:
            runtime = time.time() - (self._start or time.time())
            out["train_runtime"] = round(runtime, 4)
            if runtime:
                out["train_tokens_per_second"] = round(self._session_tokens / runtime, 3)
        return out

    def logged(self, step: int, lr: float, grad_norm: float | None, metrics: dict | None = None) -> dict:
        """At a logged step: the log_history entry (its loss the interval's mean; with the stage's metrics, e.g.
        rewards/*), returned."""
        loss = sum(self._interval) / max(len(self._interval), 1)
        self._interval = []
        entry = {"loss": loss, **({"grad_norm": grad_norm} if grad_norm is not None else {}), "learning_rate": lr,
                 **(metrics or {}), "epoch": self.epoch(step), **self._tokens(speed=True), "step": step}
        self.log_history.append(entry)
        return entry

    def finish(self, step: int, **state) -> None:
        """The closing metrics into log_history and the three files (rank 0, after the last step); state: more
        TrainerState fields (best_metric, best_global_step)."""
        runtime = time.time() - (self._start or time.time())
        steps = step - (self._first_step or 0)
        metrics = {"train_runtime": round(runtime, 4)}
        if runtime:
            samples = self.global_batch * steps  # the Trainer's max_steps x batch, times steps / max_steps
            metrics.update(train_samples_per_second=round(samples / runtime, 3),
                           train_steps_per_second=round(steps / runtime, 3))
        metrics.update(total_flos=self.total_flos, train_loss=sum(self._losses) / max(len(self._losses), 0.001),
                       epoch=self.epoch(step), **self._tokens(speed=False))  # Trainer.log adds them to the metrics
        self.log_history.append({**metrics, "step": step})
        self._write_state(step, **state)
        for name in ("train_results.json", "all_results.json"):
            path = self.dir / name
            combined = json.loads(path.read_text()) if name == "all_results.json" and path.exists() else {}
            path.write_text(json.dumps({**combined, **metrics}, indent=4, sort_keys=True) + "\n")

    def _write_state(self, step: int, **fields) -> None:
        from transformers import TrainerState

        state = TrainerState(epoch=self.epoch(step), global_step=step, max_steps=self.max_steps,
                             logging_steps=self.logging_steps, save_steps=self.save_steps,
                             train_batch_size=self.micro_batch, num_train_epochs=self.num_train_epochs,
                             total_flos=self.total_flos, log_history=self.log_history,
                             num_input_tokens_seen=self.tokens_seen, **fields)
        state.save_to_json(str(self.dir / "trainer_state.json"))

    def state_dict(self) -> dict:
        return {"log_history": self.log_history, "total_flos": self.total_flos, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.log_history, self.total_flos = list(state["log_history"]), float(state["total_flos"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
