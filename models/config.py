"""Model and optimizer settings, with the presets a run is created from."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A GPT-style decoder over byte tokens.

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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def n_blocks(self) -> int:
        """Blocks a stage range indexes: embedding + transformer blocks + head."""
        return self.n_layer + 2

    def to_dict(self) -> dict:
        return asdict(self)


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


PRESETS = {"tiny": tiny, "small": small, "base": base}


def preset(name: str) -> tuple[ModelConfig, OptimizerConfig]:
    """The model and optimizer settings of a named preset."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
