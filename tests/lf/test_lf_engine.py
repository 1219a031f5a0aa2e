"""backends.lf end to end on the tiny Qwen3: LLaMA-Factory YAMLs as users write them, the numbers
against plain transformers, what it leaves in output_dir, and one clear error for bad input."""

import json
import math
import re

import pytest
import torch
import yaml

from tests.helpers.lf_runs import TINY, add_lf, end_event, lf_file, losses, metrics, run_lf


def reference_loss(path, packed_alone: bool = False, crossed: bool = False) -> float:
    """The first optimizer step's loss from an unpatched transformers model on the engine's own first
    micro-batches (the token-mean over all of them). packed_alone: every packed document on its own; crossed:
    each row whole with its restarting position ids and LLaMA-Factory's all-ones attention mask."""
    from transformers import AutoModelForCausalLM

    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command

    recipe = LFRecipe(parse_command(["train", str(path)]))
    recipe.build(init_runtime("cpu"))
    batches = recipe.next_micro_batches()
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            ids, labels, pos = mb["input_ids"], mb["labels"], mb["position_ids"]
            for row in range(ids.shape[0]):
                starts = (pos[row] == 0).nonzero().flatten().tolist() if packed_alone else [0]
                for a, b in zip(starts, starts[1:] + [ids.shape[1]]):
                    extra = {"position_ids": pos[row:row + 1], "attention_mask": torch.ones_like(ids[row:row + 1])} \
                        if crossed else {}
                    logits = model(ids[row:row + 1, a:b], **extra).logits[0].float()
                    y = labels[row, a:b]  # already shifted: the target of each position
                    keep = y != -100
                    if keep.any():
                        total += float(torch.nn.functional.cross_entropy(logits[keep], y[keep], reduction="sum"))
                        count += int(keep.sum())
    return total / count


@pytest.fixture(scope="module")
def runs(engine_runs, tmp_path_factory):
    """The file's training runs but those that must fail, added at once so that they train in one launch
    (tests/helpers/engine_runs.py): name -> (its training file, a function giving its output dir)."""
    tmp = tmp_path_factory.mktemp("lf-engine")
    files = {
        "first": lf_file(tmp / "first", max_steps=1),
        "neat": lf_file(tmp / "neat", max_steps=1, packing=True, neat_packing=True, cutoff_len=512),
        "crossed": lf_file(tmp / "crossed", max_steps=1, packing=True, cutoff_len=512),
        # 12 steps with warmup and cosine decay, LLaMA-Factory's defaults elsewhere; the loss curve drawn
        "sft": lf_file(tmp / "sft", max_steps=12, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_ratio=0.2,
                       plot_loss=True),
        "lora": lf_file(tmp / "lora", finetuning_type="lora", lora_rank=4, lora_target="q_proj,v_proj",
                        learning_rate=1e-2, max_steps=6),
        "freeze": lf_file(tmp / "freeze", finetuning_type="freeze", freeze_trainable_layers=1, max_steps=2),
        "straight": lf_file(tmp / "a", max_steps=4, save_steps=2, save_strategy="steps"),
        "stopped": lf_file(tmp / "b", max_steps=4, save_steps=2, save_strategy="steps"),
    }
    side = tmp / "engine.yaml"  # the same run stopped after step 2 by the sidecar's exit interval, then again
    side.write_text(yaml.safe_dump({"exit_interval": 2}))
    for name, path in files.items():
        env = {"AF_PLOT": "1"} if name == "sft" else {"AF_ENGINE_FILE": str(side)} if name == "stopped" else {}
        add_lf(engine_runs, f"lf-engine/{name}", path, env=env)
    add_lf(engine_runs, "lf-engine/resumed", files["stopped"], after="lf-engine/stopped")
    out = {name: (path, lambda n=name: engine_runs[f"lf-engine/{n}"]) for name, path in files.items()}
    out["resumed"] = (files["stopped"], lambda: engine_runs["lf-engine/resumed"])
    out["log"] = engine_runs.log
    return out


def test_first_step_loss_equals_transformers(runs):
    path, out = runs["first"]
    assert losses(out())[0] == pytest.approx(reference_loss(path), abs=1e-5)


def test_model_trains_in_train_mode_and_keeps_its_kernels(tmp_path):
    """from_pretrained leaves eval mode: the engine switches to train mode (LoRA dropout acts), and a
    later train() / eval() switch does not put transformers' forwards back over the kernel patches."""
    from backends.common.distributed import init_runtime
    from backends.lf.recipe import LFRecipe, parse_command

    recipe = LFRecipe(parse_command(["train", str(lf_file(tmp_path, finetuning_type="lora", lora_dropout=0.5))]))
    recipe.build(init_runtime("cpu"))
    hf = recipe.model.hf
    assert all(m.training for m in hf.modules())
    batch = recipe.next_micro_batches()[0]
    with torch.no_grad():
        for name, weight in hf.named_parameters():
            if "lora_B" in name:  # B starts at zero, where dropout before A changes nothing
                weight.normal_(0, 0.5)
        noisy = [float(recipe.loss(recipe.model, batch).sum) for _ in range(2)]
        hf.eval()
        assert noisy[0] != noisy[1]  # LoRA dropout draws a new mask each forward
        assert float(recipe.loss(recipe.model, batch).sum) == float(recipe.loss(recipe.model, batch).sum)
        hf.train()
    assert hf.model.norm.forward.__func__.__name__ == "_rmsnorm_forward"


def test_neat_packing_keeps_packed_samples_apart(runs):
    """neat_packing: each packed sample's loss is the one it has alone (plain transformers, no packing);
    packing without it lets a row's samples see each other, which changes the loss."""
    path, out = runs["neat"]
    out = out()
    rows = int(re.search(r"64 samples in (\d+) neat-packed rows", runs["log"]("lf-engine/neat")).group(1))
    assert rows < 32  # several of the 64 samples share each row
    neat = losses(out)[0]
    assert neat == pytest.approx(reference_loss(path, packed_alone=True), abs=1e-5)
    crossed = losses(runs["crossed"][1]())[0]
    assert crossed == pytest.approx(reference_loss(runs["crossed"][0], crossed=True), abs=1e-5)
    assert abs(crossed - neat) > 1e-4


@pytest.fixture(scope="module")
def sft_run(runs):
    return runs["sft"][1]()


def test_sft_loss_falls_and_follows_hf_schedule(sft_run):
    from transformers import get_scheduler

    rows = [r for r in metrics(sft_run) if "step" in r and "event" not in r]
    assert len(rows) == 12 and rows[-1]["loss"] < rows[0]["loss"] - 0.5
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    sched = get_scheduler("cosine", opt, num_warmup_steps=math.ceil(0.2 * 12), num_training_steps=12)
    expected = []
    for _ in range(12):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [r["lr"] for r in rows] == pytest.approx(expected, rel=1e-6)


def test_sft_leaves_what_llamafactory_leaves(sft_run):
    from transformers import AutoModelForCausalLM

    log = [json.loads(x) for x in (sft_run / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in log] == [*range(1, 13), 12]  # the last line: LogCallback's closing log
    assert {"total_steps", "loss", "lr", "epoch", "percentage", "elapsed_time", "remaining_time"} <= set(log[0])
    assert "loss" not in log[-1] and "throughput" not in log[0]
    assert log[-1]["percentage"] == 100.0 and log[-1]["total_steps"] == 12
    assert (sft_run / "training_loss.png").stat().st_size > 0
    trained = AutoModelForCausalLM.from_pretrained(sft_run).eval()
    base = AutoModelForCausalLM.from_pretrained(TINY).eval()
    ids = torch.tensor([[5, 9, 33, 120, 7]])
    with torch.no_grad():
        assert (trained(ids).logits - base(ids).logits).abs().max() > 1e-3  # it is the trained model
    assert (sft_run / "tokenizer.json").is_file() and (sft_run / "checkpoints").is_dir()
    assert end_event(sft_run)["step"] == 12
    # transformers' Trainer files: its own TrainerState reads trainer_state.json back
    from transformers import TrainerState

    state = TrainerState.load_from_json(str(sft_run / "trainer_state.json"))
    rows = [r for r in metrics(sft_run) if "step" in r and "event" not in r]
    assert state.global_step == 12 and state.max_steps == 12
    assert [e["loss"] for e in state.log_history[:-1]] == pytest.approx([r["loss"] for r in rows], abs=1e-6)
    assert [e["learning_rate"] for e in state.log_history[:-1]] == pytest.approx([r["lr"] for r in rows])
    results = json.loads((sft_run / "train_results.json").read_text())
    assert results == json.loads((sft_run / "all_results.json").read_text()) == \
        {k: v for k, v in state.log_history[-1].items() if k != "step"}
    assert results["train_loss"] == pytest.approx(sum(r["loss"] for r in rows) / 12, abs=1e-6)
    # 6 x the parameters outside the embeddings x every input position (PreTrainedModel.floating_point_ops)
    dense = sum(p.numel() for p in base.parameters()) - base.get_input_embeddings().weight.numel()
    positions = results["total_flos"] / (6 * dense)
    assert positions == int(positions) and positions >= sum(r["trained_tokens"] for r in rows)


def test_trainer_outputs_log_the_interval_mean(tmp_path):
    """A logged loss is the mean of the steps since the last log, as the Trainer logs it; train_loss the mean of
    all; the files round-trip through transformers' TrainerState."""
    from transformers import TrainerState

    from backends.lf.outputs import TrainerOutputs

    out = TrainerOutputs(tmp_path, max_steps=4, batches_per_epoch=4, accumulation=2, logging_steps=2, save_steps=500,
                         micro_batch=1, num_train_epochs=2, flops_params=10, global_batch=4)
    for step, loss in enumerate((4.0, 2.0, 1.0, 3.0), start=1):
        out.stepped(step, loss, tokens=7)
        if step % 2 == 0:
            out.logged(step, lr=0.1, grad_norm=1.0)
    out.finish(4)
    state = TrainerState.load_from_json(str(tmp_path / "trainer_state.json"))
    assert [(e["step"], e["loss"], e["epoch"]) for e in state.log_history[:2]] == [(2, 3.0, 1.0), (4, 2.0, 2.0)]
    assert state.log_history[-1]["train_loss"] == 2.5 and state.total_flos == 6 * 10 * 7 * 4


def test_the_trainer_log_has_the_trainers_logs_and_epochs(tmp_path):
    """trainer_log.jsonl and log_history as HF Trainer + LogCallback leave them: a line per logging_steps (not the
    last step the shared loop also records), the epoch counting micro-batches (3 an epoch, 2 a step: 1.0 after
    step 2, 2 + 2/3 after step 5), a closing line without loss, no throughput unless tokens are counted."""
    from types import SimpleNamespace

    from backends.lf.outputs import TrainerOutputs
    from backends.lf.recipe import LFRecipe

    recipe = LFRecipe(SimpleNamespace(output_dir=str(tmp_path), engine={"export_hf": False}))
    recipe.rt = SimpleNamespace(is_main=True)
    recipe.outputs = TrainerOutputs(tmp_path, max_steps=5, batches_per_epoch=3, accumulation=2, logging_steps=2,
                                    save_steps=500, micro_batch=1, num_train_epochs=3, flops_params=10,
                                    global_batch=2)
    recipe._first_step = 0
    for step in range(1, 6):
        recipe.outputs.stepped(step, float(step), tokens=4)
        if step % 2 == 0 or step == 5:  # what backends.common.trainer records
            recipe.logged({"step": step, "lr": 0.1 * step, "grad_norm": 1.0, "tokens_per_s": 9.0,
                           "trained_tokens": 4})
    recipe.export(SimpleNamespace(step=5))
    log = [json.loads(x) for x in (tmp_path / "trainer_log.jsonl").read_text().splitlines()]
    assert [(r["current_steps"], r.get("loss"), r.get("lr"), r["epoch"]) for r in log] == \
        [(2, 1.5, 0.2, 1.0), (4, 3.5, 0.4, 2.0), (5, None, None, 2 + 2 / 3)]
    assert not {"throughput", "total_tokens"} & {k for r in log for k in r}
    history = json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
    assert [(e["step"], e["epoch"]) for e in history] == [(2, 1.0), (4, 2.0), (5, 2 + 2 / 3)]
    assert history[-1]["train_loss"] == 3.0


def test_logging_and_save_steps_below_one_are_fractions_of_the_run(tmp_path):
    from transformers import TrainerState, TrainingArguments

    from backends.lf.recipe import interval_steps

    for logging, save, total in ((0.3, 0.5, 7), (2, 0.1, 40), (5, 3, 7)):
        state = TrainerState()
        state.compute_steps(TrainingArguments(output_dir=str(tmp_path), logging_steps=logging, save_steps=save,
                                              report_to="none"), total)
        assert (interval_steps(logging, total), interval_steps(save, total)) == (state.logging_steps, state.save_steps)


def test_lora_adapter_loads_in_peft_and_base_is_untouched(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = runs["lora"][1]()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8  # LLaMA-Factory's default alpha: 2 × rank
    assert not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(TINY).eval()
    ids = torch.tensor([[5, 9, 33, 120, 7]])
    with torch.no_grad():
        plain = base(ids).logits
        tuned = PeftModel.from_pretrained(base, out).eval()(ids).logits
    assert (tuned - plain).abs().max() > 1e-4
    start = next(r for r in metrics(out) if r.get("event") == "start")
    assert start["trainable"] < start["parameters"] / 10


def test_freeze_trains_only_the_last_layers(runs):
    from safetensors.torch import load_file

    trained, base = load_file(runs["freeze"][1]() / "model.safetensors"), load_file(TINY / "model.safetensors")
    last = max(int(k.split(".")[2]) for k in base if k.startswith("model.layers."))
    changed = {k for k in base if not torch.equal(trained[k], base[k])}
    assert changed and all(k.startswith(f"model.layers.{last}.") for k in changed), sorted(changed)


def test_resume_continues_the_same_run(runs):
    straight, stopped = runs["straight"][1](), runs["stopped"][1]()
    assert len(losses(stopped)) == 2
    runs["resumed"][1]()
    assert losses(stopped) == losses(straight)


@pytest.mark.parametrize("change,needle", [
    ({"lora_rnak": 8}, "lora_rnak: not a LLaMA-Factory 0.9.5 training key; did you mean 'lora_rank'?"),
    ({"dataset": "missing"}, "dataset: 'missing' is not in"),
    ({"template": "nonesuch"}, "template: 'nonesuch' is not a template"),
    ({"deepspeed": "nowhere.json"}, "deepspeed:"),
    ({"learning_rate": "fast"}, "learning_rate must be a number"),
    ({"stage": "ppo"}, "stage must be one of pt, sft, rm, dpo, kto (ppo is not built here)"),
])
def test_bad_input_is_one_clear_error(tmp_path, change, needle):
    path = lf_file(tmp_path, **change)
    res = run_lf(path, check=False)
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_finished_model_in_output_dir_is_not_trained_over(tmp_path):
    """As LLaMA-Factory: output_dir holding a model but no checkpoint to resume is refused (nothing is
    overwritten) unless overwrite_output_dir."""
    import shutil

    path = lf_file(tmp_path, max_steps=1)
    (tmp_path / "out").mkdir()
    shutil.copy(TINY / "model.safetensors", tmp_path / "out" / "model.safetensors")
    res = run_lf(path, check=False)
    assert res.returncode == 2 and "overwrite_output_dir" in res.stderr, res.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (TINY / "model.safetensors").read_bytes()
    run_lf(path, "overwrite_output_dir=true")
    assert len(losses(tmp_path / "out")) == 1
