"""The job spec: one pydantic model for every framework, with errors a person can act on.

Reading a job file and reporting its problems is ascendfactory/job_file.py.
"""


from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from backends.contract import layout as L
from backends.contract.trackers import TRACKERS
from ascendfactory.frameworks import BACKENDS, DEFAULT_BACKEND, FRAMEWORK_BACKENDS, FRAMEWORKS
from ascendfactory.frameworks.rl import RL_STAGES, TRAINED_ROLES

Framework = Literal[FRAMEWORKS]  # type: ignore[valid-type]  (the registry's names)
Stage = Literal["pt", "sft", "dpo", "grpo", "dapo", "ppo"]
ROLES = ("actor", "reference", "critic", "rollout", "reward")


# ---------------------------------------------------------------- bounded integers
# Every integer of a job has an upper bound, checked while the file is read: the planner builds
# lists as long as pp and loops over layers, so a stray 2**63 must stop here. The layout bounds
# come from backends.contract.layout (one source of truth); the others sit far above any real run.
MAX_STEPS = 10 ** 9
MAX_SAMPLES = 10 ** 12
MAX_LORA_RANK = 1 << 14
MAX_SEED = 2 ** 32 - 1          # numpy's seeds stop here
MAX_ARCH_NUMBER = 1 << 40       # any architecture number in model_overrides


def _out_of_range(value: int, lo: int, hi: int, hint: str) -> PydanticCustomError:
    return PydanticCustomError("int_out_of_range", "{shown} is out of range: allowed whole numbers {lo} … {hi}",
                               {"shown": L.show_number(value), "lo": lo, "hi": hi, "hint": hint})


def show_value(value: Any) -> str:
    """A value as an error message shows it: huge numbers by size, long text cut."""
    if isinstance(value, int) and not isinstance(value, bool):
        return L.show_number(value)
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


NAME_MAX = 255   # bytes in one path component (Linux)
PATH_MAX = 4095  # bytes in a whole path


def _local_path(value: str) -> str:
    """A path the file system can hold: checked here so that no later stat() raises on it."""
    raw = value.encode("utf-8", "surrogatepass")
    if b"\x00" in raw:
        raise ValueError("a path cannot hold a NUL character")
    longest = max(len(part) for part in raw.split(b"/"))
    if len(raw) > PATH_MAX or longest > NAME_MAX:
        raise ValueError(f"path of {len(raw)} bytes (longest name {longest}) is longer than a file system allows "
                         f"({PATH_MAX} in all, {NAME_MAX} a name): fix the path")
    return value


LocalPath = Annotated[str, AfterValidator(_local_path)]


def bounded(lo: int, hi: int, hint: str):
    """An int type that holds its value to lo … hi, with what to do when it does not."""
    def check(value: int) -> int:
        if not lo <= value <= hi:
            raise _out_of_range(value, lo, hi, hint)
        return value

    return Annotated[int, AfterValidator(check), Field(json_schema_extra={"minimum": lo, "maximum": hi})]


ParallelSize = bounded(1, L.MAX_PARALLEL, "a parallel size is at most the number of devices: lower it")
SeqLen = bounded(8, L.MAX_SEQ_LEN, "tokens per sample; lower it")
Tokens = bounded(1, L.MAX_SEQ_LEN, "a token count, at most one sequence length: lower it")
Batch = bounded(1, L.MAX_BATCH, "samples per step; lower it")
Steps = bounded(1, MAX_STEPS, "a step count; lower it")
Count = bounded(1, 10 ** 6, "a repeat count; lower it")
StageLayers = bounded(1, L.MAX_LAYERS, "give each pipeline stage its layer count")


# architecture numbers model_overrides may set: (lowest, highest); other numbers: ± MAX_ARCH_NUMBER
_ARCH_BOUNDS = {
    "num_layers": (1, L.MAX_LAYERS), "num_attention_heads": (1, L.MAX_HEADS), "num_kv_heads": (1, L.MAX_HEADS),
    "num_experts": (1, L.MAX_EXPERTS), "experts_per_token": (1, L.MAX_EXPERTS),
    **{k: (1, MAX_ARCH_NUMBER) for k in ("hidden_size", "ffn_hidden_size", "head_dim", "vocab_size",
                                         "max_position_embeddings", "moe_ffn_hidden_size", "moe_layer_freq",
                                         "norms_per_layer")},
    **{k: (0, MAX_ARCH_NUMBER) for k in ("shared_experts", "first_k_dense", "num_nextn_predict_layers",
                                         "sliding_window", "sliding_window_pattern", "n_group", "topk_group",
                                         "query_pre_attn_scalar")},
}


# architecture entries that are blocks, not numbers, with numbers in them model_overrides can set
_ARCH_BLOCKS = {"moe": "set the numbers in it instead, e.g. num_experts: 8",
                **{k: "point model_path at a config.json that has it" for k in ("mla", "rope_scaling", "mrope_section")}}


class _Block(BaseModel):
    # inf / nan in a float field is a typo, never a setting (and breaks the arithmetic of the plan)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class LoraSpec(_Block):
    rank: bounded(1, MAX_LORA_RANK, "LoRA ranks above the hidden size add nothing: lower it") = Field(
        8, description="LoRA rank r (MindSpeed --lora-r, LLaMA-Factory lora_rank)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] = Field(
        default_factory=lambda: ["all"],
        description="linear layers to adapt: 'all' or names such as q_proj, k_proj, v_proj, o_proj, "
                    "gate_proj, up_proj, down_proj")
    merge_on_export: bool = Field(False, description="also write merged full weights at HF export")


class FreezeSpec(_Block):
    """Partial-parameter fine-tuning: the last (or first) layers train, the rest stay frozen."""
    trainable_layers: bounded(-L.MAX_LAYERS, L.MAX_LAYERS, "at most the model's layer count: lower it") = Field(
        2, description="layers that train: the last N, or the first |N| when negative "
                       "(LLaMA-Factory freeze_trainable_layers)")
    trainable_modules: list[str] = Field(
        default_factory=lambda: ["all"],
        description="modules of those layers that train: 'all' or names such as self_attn, mlp")
    extra_modules: list[str] = Field(
        default_factory=list, description="modules outside the layers that also train, e.g. embed_tokens, lm_head")

    @field_validator("trainable_layers")
    @classmethod
    def _nonzero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 layers would train nothing: use a positive count (the last layers) or a negative one "
                             "(the first layers)")
        return value


class VisionSpec(_Block):
    """Vision-language models: which parts train, and the pixel budget images are resized into."""
    freeze_tower: bool = Field(True, description="keep the vision tower frozen (LLaMA-Factory freeze_vision_tower)")
    freeze_projector: bool = Field(True, description="keep the projector / patch merger frozen "
                                                     "(freeze_multi_modal_projector)")
    freeze_language_model: bool = Field(False, description="keep the language model frozen (freeze_language_model)")
    image_max_pixels: bounded(1, 1 << 30, "pixels of one image after resizing: lower it") = Field(
        589824, description="larger images are scaled down to at most this many pixels")
    image_min_pixels: bounded(1, 1 << 30, "pixels of one image after resizing: lower it") = Field(
        1024, description="smaller images are scaled up to at least this many pixels")

    @model_validator(mode="after")
    def _bounds(self):
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError(f"image_min_pixels {self.image_min_pixels} is above image_max_pixels "
                             f"{self.image_max_pixels}")
        if self.freeze_tower and self.freeze_projector and self.freeze_language_model:
            raise ValueError("freeze_tower, freeze_projector and freeze_language_model all true would train nothing")
        return self


class DataSpec(_Block):
    path: LocalPath = Field(..., description="data file or directory (JSON/JSONL/parquet), or a Megatron prefix")
    format: Literal["alpaca", "sharegpt", "text", "pairwise", "prompt"] = "alpaca"
    template: Optional[str] = Field(None, description="chat template name; default: the model's own")
    seq_len: SeqLen = Field(2048, description="sequence length (cutoff_len / --seq-length)")
    packing: bool = Field(False, description="pack several samples into one row (documents stay separate)")
    neat_packing: bool = Field(False, description="packing without cross-document attention (needs packing)")
    dynamic_seq_len: bool = Field(False, description="pad each batch only to its longest sample")
    pad_to_multiple_of: bounded(1, L.MAX_SEQ_LEN, "a small power of two such as 8 or 64") = 8
    shuffle: bool = True
    max_samples: Optional[bounded(1, MAX_SAMPLES, "lower it, or leave it out for the whole data set")] = None
    answer_key: Optional[str] = Field(None, description="RL prompts: field that holds the reference answer")


class LayoutSpec(_Block):
    """How one model is split over the devices (backends.contract.layout checks it)."""
    tp: ParallelSize = Field(1, description="tensor parallel size")
    pp: ParallelSize = Field(1, description="pipeline parallel size")
    vpp: bounded(1, L.MAX_PARALLEL, "model chunks per pipeline rank: a divisor of each stage's layers") = Field(
        1, description="virtual pipeline stages per pipeline rank (interleaved 1F1B)")
    pp_layers: Optional[Annotated[list[StageLayers], Field(max_length=L.MAX_PARALLEL)]] = Field(
        None, description="explicit layers per pipeline stage")
    cp: ParallelSize = Field(1, description="context parallel size")
    cp_algo: Literal["ring", "ulysses", "hybrid"] = "ring"
    ulysses_degree: Optional[ParallelSize] = Field(None, description="Ulysses group size inside CP (hybrid)")
    ep: ParallelSize = Field(1, description="expert parallel size")
    sp: bool = Field(False, description="sequence parallel (needs tp > 1)")


class ParallelSpec(LayoutSpec):
    moe_dispatcher: Literal["alltoall", "alltoall_seq", "allgather"] = Field(
        "alltoall", description="MoE token dispatcher (--moe-token-dispatcher-type); LoRA on MoE needs alltoall_seq")
    zero: bounded(0, 3, "ZeRO stages are 0, 1, 2 and 3") = Field(
        0, description="ZeRO stage (LLaMA-Factory's DeepSpeed stages)")
    fsdp: bool = Field(False, description="shard parameters, gradients and optimizer states with FSDP2")
    distributed_optimizer: bool = Field(False, description="shard optimizer states over data parallel")
    recompute: Literal["none", "selective", "full"] = "none"


class KernelSpec(_Block):
    flash_attention: bool = Field(True, description="fused flash attention (npu_fusion_attention / flash-attn / SDPA)")
    fused_ops: bool = Field(True, description="fused RMSNorm, SwiGLU and rotary kernels")
    backend: Literal["auto", "reference", "npu", "cuda"] = "auto"
    overrides: dict[str, Literal["auto", "reference", "npu", "cuda"]] = Field(default_factory=dict)


class TrainSpec(_Block):
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: bounded(0, MAX_STEPS, "a step count; lower it") = 0
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, gt=0, lt=1)
    adam_beta2: float = Field(0.95, gt=0, lt=1)
    global_batch: Batch = Field(8, description="samples per optimizer step over all data-parallel ranks")
    micro_batch: Batch = Field(1, description="samples per forward pass on one rank")
    steps: Optional[Steps] = Field(None, description="optimizer steps (or give epochs)")
    epochs: Optional[float] = Field(None, gt=0, le=10 ** 6)
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    seed: bounded(0, MAX_SEED, "use a seed in 0 … 2**32-1") = 42
    log_interval: Steps = 1
    save_interval: Optional[Steps] = Field(None, description="steps between resume checkpoints")
    grad_clip: Optional[float] = Field(1.0, gt=0)
    moe_aux_loss_coeff: float = Field(0.01, ge=0)
    export_hf: bool = Field(True, description="write a Hugging Face export at the end")
    report_to: list[Literal[TRACKERS]] = Field(
        default_factory=list, description="experiment trackers, written in the run directory by the framework's own "
                                          "keys (W&B offline unless WANDB_MODE says otherwise)")

    @field_validator("report_to")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give train.steps or train.epochs, not both")
        if self.steps is None and self.epochs is None:
            self.steps = 100
        return self


class RoleSpec(_Block):
    parallel: Optional[LayoutSpec] = Field(
        None, description="this role's layout over the same devices; keys left out: the job's parallel block")


class TrainedRoleSpec(RoleSpec):
    lr: Optional[float] = Field(None, gt=0, description="this role's learning rate; default train.lr")


class CriticSpec(TrainedRoleSpec):
    micro_batch: Optional[Batch] = Field(None, description="responses per forward pass of the critic on one rank "
                                                           "(VeRL critic.ppo_micro_batch_size_per_gpu); default "
                                                           "train.micro_batch")


class RolloutLayoutSpec(_Block):
    tp: ParallelSize = Field(1, description="tensor parallel size of the generation engine")
    pp: ParallelSize = Field(1, description="pipeline parallel size of the generation engine")
    ep: ParallelSize = Field(1, description="expert parallel size of the generation engine")


class RolloutSpec(_Block):
    parallel: Optional[RolloutLayoutSpec] = Field(None, description="the generation engine's layout; keys left "
                                                                    "out: the job's parallel tp / ep, and pp 1 (the "
                                                                    "training's stages gathered for generation)")
    n: bounded(1, 1 << 16, "responses per prompt; lower it") = Field(8, description="responses sampled per prompt")
    engine: Literal["vllm", "sglang", "hf"] = "vllm"
    max_new_tokens: Tokens = Field(512, description="longest response")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="engine vllm: the share of device memory "
                                          "vLLM may take for weights and KV cache (VeRL's and MindSpeed-RL's key)")
    enforce_eager: bool = Field(True, description="engine vllm: no CUDA graphs / compiled model (quicker start, "
                                                   "slower decode)")


# the keys an older job file may still write flat under rl: (moved into rl.rollout)
ROLLOUT_KEYS = ("n", "engine", "max_new_tokens", "temperature", "top_p")


class RewardSpec(RoleSpec):
    type: Literal["gsm8k", "math", "exact_match", "length", "function", "model"] = Field(
        "gsm8k", description="a rule (gsm8k, math, exact_match, length), your function, or a reward model")
    function: Optional[str] = Field(None, description="module:function for type=function")
    model_path: Optional[LocalPath] = Field(None, description="Hugging Face reward model directory for type=model")

    @model_validator(mode="after")
    def _kind(self):
        problems = []
        if (self.type == "function") != (self.function is not None):
            problems.append("rl.reward.function (module:function) goes with type: function, and only with it")
        if (self.type == "model") != (self.model_path is not None):
            problems.append("rl.reward.model_path goes with type: model, and only with it")
        if self.parallel is not None and self.type != "model":
            problems.append(f"a rule reward ({self.type}) runs no model: rl.reward.parallel needs type: model")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class RLSpec(_Block):
    kl_coef: float = Field(0.001, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    clip_eps_high: Optional[float] = Field(None, gt=0, description="default: 0.28 for dapo, else clip_eps_low")
    dual_clip_c: float = Field(3.0, gt=1)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    ppo_epochs: Count = 1
    mini_batch: Optional[Batch] = Field(None, description="prompts per policy update (default: global)")
    overlong_buffer: Optional[Tokens] = Field(None, description="DAPO soft overlong punishment buffer")
    max_gen_rounds: Count = Field(3, description="DAPO dynamic sampling: generation rounds at most")
    actor: TrainedRoleSpec = Field(default_factory=TrainedRoleSpec, description="the policy that trains")
    reference: RoleSpec = Field(default_factory=RoleSpec, description="the frozen policy the KL term compares to; "
                                "keys its parallel block leaves out: the actor's layout")
    critic: Optional[CriticSpec] = Field(None, description="the value model (ppo only)")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="generation of the responses")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="how responses are scored")

    @model_validator(mode="before")
    @classmethod
    def _rollout_keys_at_rl_level(cls, data: Any) -> Any:
        """Job files written before the role blocks give n, engine, … directly under rl: they belong
        to the rollout, and move there (the same key in both places is refused)."""
        if not isinstance(data, dict) or not any(k in data for k in ROLLOUT_KEYS):
            return data
        data = dict(data)
        rollout = dict(data.get("rollout") or {})
        both = [k for k in ROLLOUT_KEYS if k in data and k in rollout]
        if both:
            raise ValueError(f"give {', '.join(f'rl.{k}' for k in both)} or rl.rollout.{both[0]}, not both")
        rollout.update({k: data.pop(k) for k in ROLLOUT_KEYS if k in data})
        data["rollout"] = rollout
        return data


class ResourceSpec(_Block):
    device: Literal["auto", "npu", "cuda", "cpu"] = "auto"
    nnodes: bounded(1, L.MAX_NODES, "the number of machines") = 1
    devices_per_node: bounded(1, L.MAX_DEVICES_PER_NODE, "accelerators (or CPU processes) per machine") = 1
    node_rank: bounded(0, L.MAX_NODES - 1, "this machine's index, below resources.nnodes") = 0
    master_addr: str = "127.0.0.1"
    master_port: bounded(1, 65535, "a TCP port") = 29500
    device_memory_gib: Optional[float] = Field(
        None, gt=0, description="memory of one device; default 64 (npu), 80 (cuda), none (cpu)")

    @model_validator(mode="after")
    def _rank_in_range(self):
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        return self


class SlurmSpec(_Block):
    partition: Optional[str] = None
    account: Optional[str] = None
    time_limit: str = "24:00:00"
    extra_args: list[str] = Field(default_factory=list, description="extra #SBATCH lines, e.g. --qos=high")
    cpus_per_task: Optional[bounded(1, 4096, "CPUs for one node's processes")] = Field(
        None, description="CPUs per node (one task per node runs torchrun); default: one per process")
    setup: list[str] = Field(default_factory=list, description=(
        "shell lines run before training on each node, e.g. `module load cann` or `source venv/bin/activate`; "
        "with setup the job runs the `python` they put on PATH"))
    python: Optional[str] = Field(None, description=(
        "interpreter on the compute nodes; default: this machine's (absolute path), or `python` after setup"))

    @field_validator("setup")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        import re

        bad = [i for i, line in enumerate(value) if re.search(r"[\x00-\x08\x0a-\x1f\x7f]", line)]
        if bad:
            raise ValueError(f"setup line(s) {', '.join(map(str, bad))} hold a line break or control character: "
                             "give one shell line per list item")
        return value


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


class K8sVolume(_Block):
    name: str = Field(..., description="volume name (a DNS-1123 label: lowercase letters, digits, -)")
    mount_path: LocalPath = Field(..., description="absolute path in the container")
    pvc: Optional[str] = Field(None, description="PersistentVolumeClaim name (shared storage across nodes)")
    host_path: Optional[LocalPath] = Field(None, description="a directory on the node (every node must have it)")
    read_only: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        import re

        if not re.fullmatch(_DNS_LABEL, self.name) or len(self.name) > 63:
            raise ValueError(f"volume name {self.name!r} must be a DNS-1123 label (a-z, 0-9, -; at most 63)")
        if not self.mount_path.startswith("/"):
            raise ValueError(f"mount_path {self.mount_path!r} must be absolute")
        if (self.pvc is None) == (self.host_path is None):
            raise ValueError(f"volume {self.name!r} needs exactly one of pvc or host_path")
        if self.host_path is not None and not self.host_path.startswith("/"):
            raise ValueError(f"host_path {self.host_path!r} must be absolute")
        return self


class K8sSpec(_Block):
    image: str = "ascendfactory:latest"
    namespace: str = "default"
    resource_name: Optional[str] = Field(None, description="device resource, default huawei.com/Ascend910 or nvidia.com/gpu")
    volumes: list[K8sVolume] = Field(default_factory=list, description=(
        "PVC or hostPath volumes mounted in every pod: the data, the model and the run directory live there"))
    workdir: Optional[str] = Field(None, description="the container's working directory; default: the image's")
    config_map: bool = Field(True, description=(
        "ship the rendered engine files in a ConfigMap in launch.yaml, mounted where the command reads them; "
        "false: they are read from the run directory on a shared volume (render on a machine that mounts it)"))

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        import re

        if not re.fullmatch(_DNS_LABEL, value) or len(value) > 63:
            raise ValueError(f"namespace {value!r} must be a DNS-1123 label (a-z, 0-9, -; at most 63)")
        return value


class JobSpec(_Block):
    name: Optional[str] = Field(None, description="job name; default <model>-<stage>")
    model: str = Field(..., description="model id, display name or Hugging Face repo id")
    model_path: Optional[LocalPath] = Field(None, description="local Hugging Face model directory; without it, random init from the card")
    model_overrides: dict[str, Union[int, float, bool, None]] = Field(
        default_factory=dict, description="architecture numbers to change for random init (e.g. num_layers: 2)")
    framework: Framework
    backend: Literal[BACKENDS] = Field(  # type: ignore[valid-type]
        DEFAULT_BACKEND, description="the framework's training backend: mindspeed-llm trains on Megatron (mcore) or on "
                                     "FSDP2 over Hugging Face models (fsdp2, its train_fsdp2.py YAML); the other "
                                     "frameworks have one")
    stage: Stage = "sft"
    finetuning: Literal["full", "freeze", "lora"] = Field(
        "full", description="full: every parameter; freeze: the layers a freeze block names; lora: adapters")
    lora: Optional[LoraSpec] = None
    freeze: Optional[FreezeSpec] = None
    vision: Optional[VisionSpec] = Field(None, description="vision-language models: parts to freeze, image sizes")
    data: DataSpec
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    kernels: KernelSpec = Field(default_factory=KernelSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    rl: Optional[RLSpec] = None
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    launcher: Literal["local", "torchrun", "slurm", "k8s", "modelarts"] = "torchrun"
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)
    k8s: K8sSpec = Field(default_factory=K8sSpec)
    output_dir: Optional[LocalPath] = Field(None, description="run directory; default runs/<name>")
    resume: LocalPath = Field("auto", description="auto (latest complete checkpoint), never, or a checkpoint path")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the workers")
    backend_overrides: dict[str, Any] = Field(
        default_factory=dict, description="native keys of the framework's own dialect, passed through")

    @field_validator("backend")
    @classmethod
    def _framework_backend(cls, value: str, info) -> str:
        framework = info.data.get("framework")
        offered = FRAMEWORK_BACKENDS.get(framework, (DEFAULT_BACKEND,))
        if framework is not None and value not in offered:
            raise ValueError(f"framework {framework} has no backend {value} (it has {', '.join(offered)}); "
                             f"leave backend out, or use framework: "
                             f"{' or '.join(f for f, b in FRAMEWORK_BACKENDS.items() if value in b)}")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        import re

        bad = [k for k in value if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"environment variable names must be letters, digits and _: {', '.join(map(repr, bad))}")
        return value

    @field_validator("model_overrides")
    @classmethod
    def _arch_numbers(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems = []
        for key, number in value.items():
            if key in _ARCH_BLOCKS:
                problems.append(f"{key} is a block of the architecture, not one number: {_ARCH_BLOCKS[key]}")
                continue
            lo, hi = _ARCH_BOUNDS.get(key, (None, MAX_ARCH_NUMBER))
            if lo is None:
                if isinstance(number, int) and not isinstance(number, bool) and abs(number) > hi:
                    problems.append(f"{key}: {L.show_number(number)} is out of range: allowed -{hi} … {hi}")
            elif number is None and lo == 0:
                continue  # an optional feature switched off (sliding_window: null)
            elif isinstance(number, bool) or not isinstance(number, int) or not lo <= number <= hi:
                problems.append(f"{key}: {show_value(number)} is out of range: allowed whole numbers {lo} … {hi}")
        if problems:
            raise ValueError("; ".join(problems) + " (architecture numbers are sizes and counts of the model)")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        from ascendfactory.catalog import closest_models, resolve_model

        model_id = resolve_model(value)
        if model_id is None:
            close = closest_models(value)
            raise ValueError(f"unknown model {show_value(value)}" + (f"; did you mean {', '.join(close)}?" if close else
                                                             "; run `ascendfactory models` for the list"))
        return model_id

    @model_validator(mode="after")
    def _consistent(self):
        problems = []
        if self.lora is not None and self.finetuning != "lora":
            problems.append("a lora block needs finetuning: lora")
        if self.finetuning == "lora" and self.lora is None:
            self.lora = LoraSpec()
        if self.freeze is not None and self.finetuning != "freeze":
            problems.append("a freeze block needs finetuning: freeze")
        if self.finetuning == "freeze" and self.freeze is None:
            self.freeze = FreezeSpec()
        problems += self._resolve_vision()
        if self.stage in RL_STAGES:
            if self.rl is None:
                self.rl = RLSpec()
            if self.rl.clip_eps_high is None:
                self.rl.clip_eps_high = 0.28 if self.stage == "dapo" else self.rl.clip_eps_low
            problems += self._resolve_roles()
        elif self.rl is not None:
            roles = [f"rl.{r}" for r in ROLES if r in self.rl.model_fields_set]
            problems.append(f"an rl block{' (here with ' + ', '.join(roles) + ')' if roles else ''} is only used by "
                            f"the RL stages {', '.join(RL_STAGES)}, not stage {self.stage}")
        if self.resume not in ("auto", "never") and not self.resume.strip():
            problems.append("resume must be auto, never or a checkpoint path")
        if self.name is None:
            self.name = f"{self.model}-{self.stage}"
        if self.output_dir is None:
            self.output_dir = f"runs/{self.name}"
        if problems:
            raise ValueError("; ".join(problems))
        return self


    def _resolve_vision(self) -> list[str]:
        """A vision-language model gets the vision defaults; a text model takes no vision block."""
        from ascendfactory.catalog import models

        card = models()[self.model]
        if card.get("type") == "multimodal":
            if self.vision is None:
                self.vision = VisionSpec()
            return []
        if self.vision is not None:
            return [f"a vision block needs a vision-language model; {self.model} is a {card.get('type', 'text')} "
                    "model: remove the vision block"]
        return []

    def _resolve_roles(self) -> list[str]:
        """Every role's layout and learning rate made explicit: what a role leaves out, it inherits."""
        rl, problems = self.rl, []
        if rl.critic is not None and self.stage != "ppo":
            problems.append(f"rl.critic: only ppo trains a critic (value model), not {self.stage}; "
                            "remove the rl.critic block")
        if rl.critic is None and self.stage == "ppo":
            rl.critic = CriticSpec()
        job_layout = self.parallel.model_dump(include=set(LayoutSpec.model_fields))
        for role in ("actor", "reference", "critic", "reward"):  # the actor before the roles that follow it
            spec = getattr(rl, role)
            if spec is None or (role == "reward" and spec.type != "model"):
                continue
            parent = ROLE_INHERITS.get(role)
            base = getattr(rl, parent).parallel.model_dump() if parent else job_layout
            spec.parallel = LayoutSpec(**_inherit(base, spec.parallel))
        # the generation engine runs the whole model per replica unless the rollout sets its own pp (VeRL's
        # rollout pipeline_model_parallel_size and MindSpeed-RL's infer_pipeline_parallel_size default to 1)
        rollout_base = {k: job_layout[k] for k in RolloutLayoutSpec.model_fields if k != "pp"}
        rl.rollout.parallel = RolloutLayoutSpec(**_inherit(rollout_base, rl.rollout.parallel))
        for role in TRAINED_ROLES:
            spec = getattr(rl, role)
            if spec is not None and spec.lr is None:
                spec.lr = self.train.lr
        return problems

    def role_layouts(self) -> dict[str, Any]:
        """The layout of every RL role that runs a model, by role ({} outside the RL stages)."""
        if self.rl is None:
            return {}
        rl = self.rl
        out = {"actor": rl.actor.parallel, "reference": rl.reference.parallel}
        if rl.critic is not None:
            out["critic"] = rl.critic.parallel
        out["rollout"] = rl.rollout.parallel
        if rl.reward.type == "model":
            out["reward"] = rl.reward.parallel
        return out


# the role whose layout an RL role inherits what it leaves out (a role not named here: the job's parallel
# block): the reference follows the actor, as MindSpeed-RL's integrated worker and VeRL's ref
# (ulysses_sequence_parallel_size, megatron tensor_model_parallel_size: ${...actor...}) do
ROLE_INHERITS: dict[str, str] = {"reference": "actor"}

# a role key that changes what these depend on does not inherit them from the job's parallel block
_DEPENDS = {"pp_layers": ("pp",), "vpp": ("pp",), "ulysses_degree": ("cp", "cp_algo"), "sp": ("tp",)}


def _inherit(base: dict[str, Any], block: Optional[BaseModel]) -> dict[str, Any]:
    given = block.model_dump(exclude_unset=True) if block is not None else {}
    out = dict(base)
    for key, deps in _DEPENDS.items():
        if key in out and key not in given and any(d in given for d in deps):
            del out[key]
    return {**out, **given}
