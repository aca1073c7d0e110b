"""What a stage computes: the GPT blocks, how a model is cut into stages, and the data.

- ``config``: ``ModelConfig`` and ``OptimizerConfig`` with the presets ``tiny``/``small``/``base``.
- ``gpt``: the blocks (embedding, transformer block, head + loss) and their seeded init.
- ``stages``: the pure cut of a config into contiguous block ranges, and the ``Stage`` module.
- ``data``: the default corpus (the Python standard library's own sources), splits, samplers.
- ``training``: the single-process reference loop (optimizer, schedule, evaluation).

Nothing here imports ``node`` or ``protocol``: distribution is applied from outside.
"""

from models.config import ModelConfig, OptimizerConfig, preset
from models.stages import Stage, StageRange, even_boundaries, validate_boundaries

__all__ = [
    "ModelConfig",
    "OptimizerConfig",
    "Stage",
    "StageRange",
    "even_boundaries",
    "preset",
    "validate_boundaries",
]
