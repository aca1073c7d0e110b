"""Model and optimizer settings, with the presets a run is created from."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal

FAMILIES = ("gpt", "llama")

# Fields added after specs were first signed. ``to_dict`` leaves them out while they hold
# their defaults, so a GPT spec written today is the spec written before they existed
# (the same signed bytes, the same "nothing changed" when a run is created again).
_LATER_FIELDS = (
    "family",
    "n_kv_head",
    "intermediate_size",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
    "activation",
    "boundary_rank",
)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: GPT-2 style (``family="gpt"``: learned positions,
    LayerNorm, GELU MLP) or Llama style (``family="llama"``: rotary positions, RMSNorm,
    SwiGLU MLP, grouped-query attention).

    The model is the ordered list of ``n_layer + 2`` blocks: block 0 is the embedding,
    blocks 1..n_layer are transformer blocks, block ``n_layer + 1`` is the head (final
    norm, projection to the vocabulary, cross-entropy loss).
    """

    vocab_size: int = 256  # byte-level tokens: every file is already tokenized
    block_size: int = 64  # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0  # 0 keeps forward passes reproducible, so a stage can recompute them
    bias: bool = True
    tie_embeddings: bool = False  # tying only works when embedding and head share a stage
    init_seed: int = 0  # every peer builds the same initial weights from this
    family: Literal["gpt", "llama"] = "gpt"  # GPT-2's blocks or Llama's (models.gpt)
    # Key/value heads of grouped-query attention (llama only): each serves
    # n_head // n_kv_head query heads. None: as many as query heads (plain multi-head).
    n_kv_head: int | None = None
    # Hidden width of the MLP. None: 4 * n_embd (GPT-2's), or for llama SwiGLU's
    # 8/3 * n_embd rounded up to a multiple of 64 (the same parameters as 4x GELU).
    intermediate_size: int | None = None
    norm_eps: float = 1e-5  # LayerNorm (gpt) or RMSNorm (llama) epsilon
    rope_theta: float = 10000.0  # llama: base of the rotary frequencies
    # llama: Llama 3's stretching of the rotary frequencies for long contexts, as
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    # (``models.llama.rotary_frequencies``); None: none.
    rope_scaling: tuple[float, float, float, int] | None = None
    # gpt: "gelu" is exact GELU; "gelu_tanh" its tanh approximation (GPT-2's "gelu_new").
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    # A low-rank stage boundary (``models.boundary``): blocks write only the first
    # ``boundary_rank`` coordinates of the residual stream, the rest hold a fixed
    # embedding of the tokens, so hidden states cross a cut as ``boundary_rank`` values
    # per token plus the token ids. None: full width, every coordinate trained.
    boundary_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(
                f"rotary embeddings need an even head size, got n_embd / n_head = {self.head_dim}"
            )
        if self.n_kv_head is not None:
            if self.family != "llama":
                raise ValueError("n_kv_head (grouped-query attention) needs family='llama'")
            if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
                raise ValueError(
                    f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
                )
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {self.intermediate_size}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(
                f"norm_eps ({self.norm_eps}) and rope_theta ({self.rope_theta}) must be > 0"
            )
        if self.rope_scaling is not None:
            self._check_rope_scaling()
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"activation must be gelu or gelu_tanh, got {self.activation!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.boundary_rank is not None and not (
            type(self.boundary_rank) is int and 1 <= self.boundary_rank < self.n_embd
        ):
            raise ValueError(
                f"boundary_rank must be an integer in [1, n_embd = {self.n_embd}) or None, "
                f"got {self.boundary_rank!r}"
            )

    def _check_rope_scaling(self) -> None:
        if self.family != "llama":
            raise ValueError("rope_scaling (rotary frequencies) needs family='llama'")
        scaling = self.rope_scaling
        if not isinstance(scaling, list | tuple) or len(scaling) != 4:
            raise ValueError(
                "rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
                f"original_max_position_embeddings), got {scaling!r}"
            )
        object.__setattr__(self, "rope_scaling", tuple(scaling))  # a list, from JSON
        factor, low, high, original = scaling
        if not (factor >= 1 and 0 < low < high and original >= 1):
            raise ValueError(
                f"rope_scaling {tuple(scaling)}: needs factor >= 1, 0 < low_freq_factor < "
                "high_freq_factor and original_max_position_embeddings >= 1"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or ``n_head`` when unset."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width (``intermediate_size`` or the architecture's default)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.family == "llama":
            return 64 * math.ceil(8 * self.n_embd / 3 / 64)
        return 4 * self.n_embd

    @property
    def boundary_width(self) -> int:
        """Values per token of the hidden states that cross a stage boundary."""
        return self.boundary_rank or self.n_embd

    @property
    def n_blocks(self) -> int:
        """Blocks a stage range indexes: embedding + transformer blocks + head."""
        return self.n_layer + 2

    def to_dict(self) -> dict:
        """The fields, less those added later that hold their defaults (``_LATER_FIELDS``):
        ``ModelConfig(**config.to_dict()) == config`` either way."""
        defaults = {f.name: f.default for f in fields(self)}
        return {k: v for k, v in asdict(self).items() if k not in _LATER_FIELDS or v != defaults[k]}


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW settings and the batch geometry of one optimizer step."""

    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 20  # linear warm-up avoids early AdamW blow-ups on tiny batches
    grad_clip: float = 1.0  # 0 disables clipping
    micro_batch_size: int = 8  # samples per forward/backward through the pipeline
    target_batch_size: int = 32  # samples per optimizer step (swarm-wide for a stage)
    # Steps a gradient may lag behind the parameters it updates. 0: a stage admits no new
    # micro-batch once its step's samples are committed, until that step is applied, so
    # every step averages gradients of exactly the parameters it updates (as one process
    # would), at the cost of a pipeline flush per step. 1: stages never hold micro-batches;
    # those computed while a step's round runs go into the next step, one step stale, and
    # a step takes whatever arrived during the round (more than the target). BENCHMARKS.md
    # ("Loss per sample") measures both.
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.target_batch_size < self.micro_batch_size:
            raise ValueError(
                f"target_batch_size ({self.target_batch_size}) must be >= "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.max_staleness not in (0, 1):
            raise ValueError(f"max_staleness must be 0 or 1, got {self.max_staleness}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps, grad_clip and weight_decay must be >= 0")

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based): linear warm-up, then flat."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    def to_dict(self) -> dict:
        return asdict(self)


def tiny() -> tuple[ModelConfig, OptimizerConfig]:
    """For tests and demos: small enough that a training step is quick on one CPU core."""
    return ModelConfig(block_size=64, n_layer=4, n_head=4, n_embd=64), OptimizerConfig()


def small() -> tuple[ModelConfig, OptimizerConfig]:
    """About 11M parameters: CPU benchmarks."""
    model = ModelConfig(block_size=256, n_layer=6, n_head=6, n_embd=384)
    return model, OptimizerConfig(lr=1e-3, micro_batch_size=8, target_batch_size=64)


def base() -> tuple[ModelConfig, OptimizerConfig]:
    """About 128M parameters (GPT-2 base width, deeper because bytes need no big vocabulary)."""
    model = ModelConfig(block_size=1024, n_layer=18, n_head=12, n_embd=768)
    return model, OptimizerConfig(lr=6e-4, micro_batch_size=8, target_batch_size=256)


def _llama(**fields) -> ModelConfig:
    # No biases and untied embeddings, as Llama has them (untied so the model can be cut).
    return ModelConfig(family="llama", bias=False, tie_embeddings=False, **fields)


def llama_tiny() -> tuple[ModelConfig, OptimizerConfig]:
    """The ``tiny`` of the llama family (byte tokens): tests and demos."""
    model = _llama(block_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=64)
    return model, OptimizerConfig()


def llama_20m() -> tuple[ModelConfig, OptimizerConfig]:
    """About 20M parameters over byte tokens: trains on CPUs."""
    model = _llama(block_size=256, n_layer=8, n_head=8, n_kv_head=4, n_embd=480)
    return model, OptimizerConfig(lr=1e-3, micro_batch_size=8, target_batch_size=64)


# The larger presets count a 32,000-token vocabulary (Llama 2's) in their parameters.


def llama_125m() -> tuple[ModelConfig, OptimizerConfig]:
    """About 125M parameters (GPT-2 base's width and depth): one 8 GB card, or CPUs."""
    model = _llama(
        vocab_size=32000, block_size=1024, n_layer=12, n_head=12, n_kv_head=4, n_embd=768
    )
    return model, OptimizerConfig(lr=6e-4, micro_batch_size=8, target_batch_size=256)


def llama_350m() -> tuple[ModelConfig, OptimizerConfig]:
    """About 345M parameters: 2+ stages on 8 GB cards, one on a 12 GB card."""
    model = _llama(
        vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_kv_head=8, n_embd=1024
    )
    return model, OptimizerConfig(lr=3e-4, micro_batch_size=4, target_batch_size=256)


def llama_1b() -> tuple[ModelConfig, OptimizerConfig]:
    """About 1.1B parameters (Llama 3.2 1B's shape): 3+ stages on 8 GB cards, 2 on 12 GB."""
    model = _llama(
        vocab_size=32000,
        block_size=2048,
        n_layer=16,
        n_head=32,
        n_kv_head=8,
        n_embd=2048,
        intermediate_size=8192,
        rope_theta=500000.0,
    )
    return model, OptimizerConfig(lr=2e-4, micro_batch_size=2, target_batch_size=512)


def finetune() -> OptimizerConfig:
    """For a run that starts from pretrained weights: a learning rate a tenth of
    pre-training's, so the first steps do not undo what the checkpoint learned."""
    return OptimizerConfig(lr=1e-4, micro_batch_size=4, target_batch_size=64)


PRESETS = {
    "tiny": tiny,
    "small": small,
    "base": base,
    "llama-tiny": llama_tiny,
    "llama-20m": llama_20m,
    "llama-125m": llama_125m,
    "llama-350m": llama_350m,
    "llama-1b": llama_1b,
}


def preset(name: str) -> tuple[ModelConfig, OptimizerConfig]:
    """The model and optimizer settings of a named preset."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
