"""Typed configuration of the trainer: model shape, parallelism, optimizer, vision encoder, run control.

Small ``@dataclass(kw_only=True, slots=True)`` objects, one per concern, checked when built. Model
shapes follow the Llama architecture (RMSNorm, SwiGLU, RoPE, GQA, output layer untied or tied to the
embedding, no linear biases) so the trained weights map one to one onto a Hugging Face
``LlamaForCausalLM`` and a vLLM engine (see ``train.hf_llama``). ``MODEL_PRESETS`` names the shapes:
``tiny`` for tests and the CPU demo, real models for GPU machines. ``ModelConfig(hf_checkpoint=DIR)``
takes the shape from the ``config.json`` of the HF checkpoint folder the rollout serves (``train.hf_config``; and its
weights, ``train.hf_llama.load_hf_checkpoint``), so trainer and engine cannot disagree on it. What may
be admitted, and the GRPO settings (advantages and the clip range of the loss), are the planner's
``admission.AdmissionConfig``, held as ``TrainConfig.admission``.

Every config round-trips through ``schemas.documents`` (the form a trainer process receives it in).
Importing this module needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from admission.config import AdmissionConfig
from flight_store.config import ClientConfig
from train.hf_config import SHAPE_FIELDS, hf_shape, language_config, read_hf_config
from train.tracking import TrackingConfig

PackMode = Literal["padded", "thd"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of a Llama-architecture GPT (Megatron ``TransformerConfig`` + ``GPTModel`` arguments).

    Example:
        >>> ModelConfig.preset("tiny").num_query_groups
        2
    """

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """Width of the SwiGLU MLP (the gate and up projections each have this many rows)."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    vocab_size: int = 128
    """Vocabulary size (must be divisible by the tensor-parallel size)."""
    max_sequence_length: int = 512
    """Longest prompt + response, in tokens."""
    rotary_base: int = 10000
    """RoPE theta."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    init_method_std: float = 0.02
    """Std of the random initialisation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype; bfloat16 needs a GPU."""
    spec: Literal["auto", "local", "te"] = "auto"
    """Layer implementation: Megatron-core local modules or TransformerEngine; ``auto`` = TE when importable."""
    tie_embeddings: bool = False
    """Share the input embedding with the output layer (HF ``tie_word_embeddings``; SmolLM2 does)."""
    hf_checkpoint: str | None = None
    """HF Llama checkpoint folder (the one the rollout serves): shape from its config.json, starting weights from
    its safetensors. An Idefics3 folder (``tiny-vl``) is a vision-language model: the fields above are then its
    text model's, and the trainer builds Megatron's ``LLaVAModel`` (``train.vl_step``).

    The shape fields above are then read from ``config.json``; one set to another value is refused."""

    def __post_init__(self) -> None:
        if self.hf_checkpoint is not None:
            self._take_shape(read_hf_config(self.hf_checkpoint), self.hf_checkpoint)
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "max_sequence_length"):
            if getattr(self, name) <= 0:
                msg = f"ModelConfig.{name} must be positive, got {getattr(self, name)}"
                raise ValueError(msg)
        if self.num_attention_heads % self.num_query_groups:
            msg = (f"num_query_groups={self.num_query_groups} must divide "
                   f"num_attention_heads={self.num_attention_heads}")
            raise ValueError(msg)
        if self.hidden_size % self.num_attention_heads:
            msg = f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
            raise ValueError(msg)

    @property
    def vision_language(self) -> bool:
        """Whether ``hf_checkpoint`` is a vision-language model (Idefics3), trained as Megatron's ``LLaVAModel``."""
        return self.hf_checkpoint is not None and read_hf_config(self.hf_checkpoint).get("model_type") == "idefics3"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @staticmethod
    def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """The shape of an HF ``LlamaForCausalLM`` ``config.json`` (``overrides``: dtype, spec, ...)."""
        return ModelConfig(**{**hf_shape(hf), **overrides})

    def _take_shape(self, hf: dict[str, Any], source: str) -> None:
        shape = hf_shape(language_config(hf), source=source)
        conflicts = [f"{name}={getattr(self, name)!r} (checkpoint: {value!r})" for name, value in shape.items()
                     if getattr(self, name) not in (value, _DEFAULT_SHAPE[name])]
        if conflicts:
            msg = (f"ModelConfig sets {', '.join(conflicts)} but hf_checkpoint={source!r} defines the shape: "
                   "drop those fields (or the preset), or the checkpoint")
            raise ValueError(msg)
        for name, value in shape.items():
            setattr(self, name, value)

    @staticmethod
    def preset(name: str) -> ModelConfig:
        """A named shape from ``MODEL_PRESETS`` (a copy, safe to modify)."""
        if name not in MODEL_PRESETS:
            msg = f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}"
            raise ValueError(msg)
        return replace(MODEL_PRESETS[name])


_DEFAULT_SHAPE: dict[str, Any] = {name: getattr(ModelConfig(), name) for name in SHAPE_FIELDS}


MODEL_PRESETS: dict[str, ModelConfig] = {
    # tests and the CPU demo: 2 layers, GQA 4 query heads over 2 KV groups
    "tiny": ModelConfig(),
    # `knit run`: the tiny Llama vLLM runs on CPU (its CPU attention needs head_dim >= 32); vocab set from the tokenizer
    "tiny-vllm": ModelConfig(hidden_size=128, ffn_hidden_size=256, vocab_size=512),
    # GPU shapes (bfloat16); token ids must come from the matching tokenizer
    "smollm2-135m": ModelConfig(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                                num_query_groups=3, vocab_size=49152, max_sequence_length=8192,
                                rotary_base=100000, tie_embeddings=True, dtype="bfloat16"),
    "llama-3.2-1b": ModelConfig(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                                num_query_groups=8, vocab_size=128256, max_sequence_length=8192,
                                rotary_base=500000, dtype="bfloat16"),
    "qwen2.5-7b-shape": ModelConfig(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                                    num_query_groups=4, vocab_size=152064, max_sequence_length=8192,
                                    rotary_base=1000000, norm_epsilon=1e-6, dtype="bfloat16"),
}
"""Named model shapes. Real-model shapes are for GPU machines (``tiny`` is the only CPU one)."""


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the world is split. The data-parallel size is ``world / (tp * pp)``."""

    tensor_parallel: int = 1
    """Tensor-parallel size."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (only 1 is supported by the trainer loop)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; ``auto`` = NCCL when CUDA exists, else gloo."""
    timeout_s: float = 600.0
    """Timeout of collectives (the planner rank may wait this long for admissible data)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            msg = f"tensor_parallel must be >= 1, got {self.tensor_parallel}"
            raise ValueError(msg)
        if self.pipeline_parallel != 1:
            msg = f"pipeline_parallel={self.pipeline_parallel} is not supported by the trainer loop (use 1)"
            raise ValueError(msg)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Megatron optimizer (Adam) settings."""

    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    adam_beta2: float = 0.999
    """Adam beta2."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            msg = f"lr must be positive, got {self.lr}"
            raise ValueError(msg)
        if self.clip_grad < 0:
            msg = f"clip_grad must be >= 0, got {self.clip_grad}"
            raise ValueError(msg)


@dataclass(kw_only=True, slots=True)
class VisionConfig:
    """The vision encoder of the multimodal trainer (Megatron-core ``CLIPViTModel`` + a projection).

    Example:
        >>> VisionConfig().patches
        4
    """

    num_layers: int = 2
    """ViT transformer layers."""
    hidden_size: int = 16
    """ViT width."""
    num_attention_heads: int = 2
    """ViT attention heads."""
    img_h: int = 28
    """Image height in pixels (images are uint8 ``[3, img_h, img_w]``)."""
    img_w: int = 28
    """Image width in pixels."""
    patch_dim: int = 14
    """Patch size (must divide ``img_h`` and ``img_w``)."""
    dedup: bool = True
    """Encode each distinct image once per mini-batch (False: once per reference, the baseline)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "img_h", "img_w", "patch_dim"):
            if getattr(self, name) <= 0:
                msg = f"VisionConfig.{name} must be positive, got {getattr(self, name)}"
                raise ValueError(msg)
        if self.img_h % self.patch_dim or self.img_w % self.patch_dim:
            msg = f"patch_dim={self.patch_dim} must divide img_h={self.img_h} and img_w={self.img_w}"
            raise ValueError(msg)
        if self.hidden_size % self.num_attention_heads:
            msg = f"num_attention_heads={self.num_attention_heads} must divide hidden_size={self.hidden_size}"
            raise ValueError(msg)

    @property
    def patches(self) -> int:
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)


Objective = Literal["ppo_rollout_old", "decoupled_ppo", "tis"]
"""The policy losses ``train.objectives`` implements (``ObjectiveConfig.objective``)."""
OBJECTIVES: tuple[str, ...] = ("ppo_rollout_old", "decoupled_ppo", "tis")


@dataclass(kw_only=True, slots=True)
class ObjectiveConfig:
    """Which policy loss the trainer minimises, and its importance-weight cap (``train.objectives``; the PPO clip
    range is ``admission.GrpoConfig``'s).

    Example:
        >>> ObjectiveConfig(objective="tis", is_cap=2.0).objective
        'tis'
    """

    objective: Objective = "ppo_rollout_old"
    """Policy loss: ``ppo_rollout_old`` (PPO clip of pi_theta / pi_rollout), ``decoupled_ppo`` (clip against a
    recomputed proximal policy, times the truncated pi_prox / pi_rollout), ``tis`` (policy gradient times the
    truncated pi_theta / pi_rollout)."""
    is_cap: float = 2.0
    """Truncation of the importance weights (``decoupled_ppo``'s behaviour weight, ``tis``'s weight); also the
    threshold of the ``is_truncated_frac`` metric under ``ppo_rollout_old``."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            msg = f"ObjectiveConfig.objective={self.objective!r} is not one of {OBJECTIVES}"
            raise ValueError(msg)
        if not (self.is_cap >= 1.0 and self.is_cap < float("inf")):
            msg = f"ObjectiveConfig.is_cap={self.is_cap!r} must be finite and >= 1"
            raise ValueError(msg)


_TEXT_ONLY: tuple[str, ...] = ("publish_weights", "save_dir", "load_dir", "progress_path", "consumed_path",
                               "checkpoint_dir", "trained_path", "resume_path")
"""TrainConfig fields only the text step supports."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one trainer run needs.

    ``vision`` selects the step: None trains the text GPT, a :class:`VisionConfig` adds the vision
    encoder (the multimodal step, images encoded once per mini-batch).

    Example:
        >>> cfg = TrainConfig(stores=["grpc://127.0.0.1:8815"], max_steps=4,
        ...                   admission=AdmissionConfig(train_batch_groups=8, group_size=4, mini_batches=2))
        >>> cfg.model.num_layers, cfg.admission.grpo.clip_high
        (2, 0.2)
    """

    stores: list[str]
    """Flight locations of every store node (``grpc://host:port``)."""
    client: ClientConfig = field(default_factory=lambda: ClientConfig(retries=20))
    """How the ranks talk to the stores: timeouts, retries (20: a store restarting from its spill log is waited
    for, ~80 s), the token file."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and backend."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    admission: AdmissionConfig
    """Rank 0's planner and the GRPO settings; ``dp_ranks`` is taken from the process group."""
    loss: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The policy loss (``--objective``) and its importance-weight cap."""
    vision: VisionConfig | None = None
    """Vision encoder of the multimodal step; None = the text step."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = until idle)."""
    idle_timeout_s: float = 60.0
    """Stop when no mini-batch becomes admissible for this long."""
    poll_interval_s: float = 0.05
    """Pause between metadata scans while waiting for admissible data."""
    supply_from_stores: bool = True
    """Give the planner the groups in flight the rollout registered with the stores (``StoreReader.inflight``),
    so ``mini_batch`` runs the exact quota feasibility test; unknown supply while no rollout registers."""
    pack: PackMode = "padded"
    """Micro-batch layout: right-padded ``[rows, max_len]`` or one packed row (THD) with cu_seqlens."""
    prefetch_depth: int = 1
    """Micro-batches fetched ahead of the one computing (0 = fetch on demand, no overlap)."""
    initial_version: int = 0
    """Policy version of the starting weights."""
    publish_weights: bool = False
    """After each step, also DoPut the weights (HF Llama names) to the stores."""
    publish_dtype: Literal["params", "bfloat16", "float32"] = "params"
    """Dtype of the published weights: the parameters' own, or a cast (bfloat16: half of float32's bytes on the
    wire; the engine then runs the rounded weights, so its logprobs differ from the trainer's by that rounding)."""
    save_dir: str | None = None
    """Megatron dist-checkpoint folder written at the end of the run."""
    export_hf_dir: str | None = None
    """The trained weights as an HF Llama checkpoint folder written here at the end of the run
    (``train.hf_llama.save_hf_checkpoint``), for serving or evaluating the trained policy with an engine."""
    load_dir: str | None = None
    """Megatron dist-checkpoint folder loaded before the first step."""
    report_path: str | None = None
    """Each rank writes a JSON report here (``{rank}`` in the path is replaced by the global rank)."""
    seed: int = 1234
    """Seed of the model initialisation."""
    progress_path: str | None = None
    """Rank 0 appends one JSON line per optimizer step here (step, version, loss, staleness of the step, ...)."""
    consumed_path: str | None = None
    """Rank 0 writes the planner's consumed trajectories (keys, step, versions, staleness) here as Parquet."""
    checkpoint_dir: str | None = None
    """Resumable checkpoints (model and optimizer, ``train.checkpointing``) go here: every ``checkpoint_every``
    steps and when the run ends."""
    checkpoint_every: int = 0
    """Write a checkpoint after every this many optimizer steps (0: only when the run ends)."""
    trained_path: str | None = None
    """Rank 0 appends the groups each step trained and the groups dropped here (``train.trained_log``)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Rank 0's experiment tracking: ``--logger`` (console, tensorboard, wandb, mlflow) and where they write."""
    resume_path: str | None = None
    """A resume document (``launcher.resume``): the planner's state at the checkpoint of step
    ``initial_version`` in ``checkpoint_dir``, which is loaded (model and optimizer) before the first step."""

    def __post_init__(self) -> None:
        if not self.stores:
            msg = "TrainConfig.stores is empty; give at least one store location"
            raise ValueError(msg)
        if self.max_steps < 0:
            msg = f"max_steps must be >= 0, got {self.max_steps}"
            raise ValueError(msg)
        if self.checkpoint_every < 0:
            msg = f"checkpoint_every must be >= 0, got {self.checkpoint_every}"
            raise ValueError(msg)
        if self.resume_path is not None and self.checkpoint_dir is None:
            msg = f"resume_path={self.resume_path!r} needs checkpoint_dir (the checkpoint to resume from)"
            raise ValueError(msg)
        if self.prefetch_depth < 0:
            msg = f"prefetch_depth must be >= 0, got {self.prefetch_depth}"
            raise ValueError(msg)
        if self.pack not in ("padded", "thd"):
            msg = f"pack must be 'padded' or 'thd', got {self.pack!r}"
            raise ValueError(msg)
        if self.parallel.timeout_s <= self.idle_timeout_s:
            msg = (f"parallel.timeout_s={self.parallel.timeout_s} must exceed idle_timeout_s={self.idle_timeout_s} "
                   "(the other ranks wait in a collective while rank 0 waits for data)")
            raise ValueError(msg)
        if self.model.vision_language:
            unsupported = [name for name in ("vision", "load_dir", "export_hf_dir") if getattr(self, name)]
            if self.loss.objective == "decoupled_ppo":
                unsupported.append("loss.objective=decoupled_ppo")
            if self.parallel.tensor_parallel != 1:
                unsupported.append(f"parallel.tensor_parallel={self.parallel.tensor_parallel}")
            if unsupported:
                msg = (f"the vision-language step (hf_checkpoint {self.model.hf_checkpoint!r}) does not support "
                       f"{unsupported} yet")
                raise ValueError(msg)
        if self.vision is not None:
            unsupported = [name for name in _TEXT_ONLY if getattr(self, name)]
            if unsupported:
                msg = f"the multimodal step (vision set) does not support {unsupported} yet; unset them or vision"
                raise ValueError(msg)
            if self.loss.objective == "decoupled_ppo":
                msg = "the multimodal step (vision set) does not recompute proximal logprobs: objective decoupled_ppo"
                raise ValueError(msg)
