"""What a stage computes: the blocks, how a model is cut into stages, and the data.

- ``config``: ``ModelConfig`` and ``OptimizerConfig`` with the presets (``tiny``/``small``/
  ``base``; ``llama-tiny``/``llama-20m``/``llama-125m``/``llama-350m``/``llama-1b``).
- ``gpt``: the blocks of both families (embedding, transformer block, head + loss) and their
  seeded init; ``llama``: what Llama adds (RMSNorm, rotary positions).
- ``memory``: what training a stage holds (weights, gradients, AdamW state).
- ``hf_format``: Hugging Face configs and tensor names of both families, both ways;
  ``hf_export``: the whole model written and read in that format; ``pretrained``: a local
  checkpoint's hashes, and one stage's tensors read from it lazily.
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
