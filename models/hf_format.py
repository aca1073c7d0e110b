"""How a ``ModelConfig`` and a stage's tensors map onto Hugging Face's formats.

Two architectures: ``GPT2LMHeadModel`` (family ``gpt``) and ``LlamaForCausalLM`` (family
``llama``). Both directions go through one table per family (``tensor_map``): each of
our tensors is one or more of theirs stacked along dim 0 (our fused ``qkv`` is Llama's
``q_proj``, ``k_proj``, ``v_proj``; our SwiGLU ``fc`` is ``gate_proj`` then ``up_proj``),
possibly transposed (GPT-2 keeps its linear layers as ``Conv1D``, weights ``(in, out)``).
Nothing here imports ``transformers``: the formats are plain JSON and tensor names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from models.config import ModelConfig

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
SUPPORTED = (LLAMA, GPT2)
FAMILY_OF = {GPT2: "gpt", LLAMA: "llama"}
ARCHITECTURE_OF = {family: arch for arch, family in FAMILY_OF.items()}

# A Llama checkpoint's context (max_position_embeddings) can be 128k tokens; a run trains
# on sequences of block_size tokens, so that is capped here (rotary positions need no
# table, so any length up to the checkpoint's works).
MAX_PRETRAINED_BLOCK_SIZE = 2048


@dataclass(frozen=True)
class HFTensor:
    """One of our tensors (``ours``: a whole-model name, ``blocks.<index>.…``) as the
    Hugging Face tensors ``theirs`` (stacked along dim 0, ``rows`` each; one tensor: all
    rows), each transposed if ``transposed``. ``fallback``: where to read it from when
    ``theirs`` is absent (a tied head reads the embedding)."""

    ours: str
    theirs: tuple[str, ...]
    rows: tuple[int, ...] | None = None
    transposed: bool = False
    fallback: str | None = None

    def join(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Our tensor from theirs, each read by ``read(name)``."""
        parts = [read(name) for name in self.theirs]
        parts = [p.t() if self.transposed else p for p in parts]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).contiguous()

    def split(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Theirs from our ``tensor``: the inverse of ``join``."""
        parts = tensor.split(list(self.rows), dim=0) if self.rows else (tensor,)
        return {
            name: (p.t() if self.transposed else p).contiguous()
            for name, p in zip(self.theirs, parts, strict=True)
        }


# (ours within a transformer block, GPT-2's within ``transformer.h.<i>``, transposed)
_GPT2_BLOCK = (
    ("ln_1.weight", "ln_1.weight", False),
    ("ln_1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True),
    ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.proj.weight", "attn.c_proj.weight", True),
    ("attn.proj.bias", "attn.c_proj.bias", False),
    ("ln_2.weight", "ln_2.weight", False),
    ("ln_2.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True),
    ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True),
    ("mlp.proj.bias", "mlp.c_proj.bias", False),
)


def _gpt2_map(config: ModelConfig, index: int, tied: bool) -> list[HFTensor]:
    head = config.n_blocks - 1
    if index == 0:
        return [
            HFTensor("blocks.0.wte.weight", ("transformer.wte.weight",)),
            HFTensor("blocks.0.wpe.weight", ("transformer.wpe.weight",)),
        ]
    if index == head:
        lm = "transformer.wte.weight" if tied else None
        return [
            HFTensor(f"blocks.{head}.ln_f.weight", ("transformer.ln_f.weight",)),
            HFTensor(f"blocks.{head}.ln_f.bias", ("transformer.ln_f.bias",)),
            HFTensor(f"blocks.{head}.lm_head.weight", ("lm_head.weight",), fallback=lm),
        ]
    return [
        HFTensor(f"blocks.{index}.{ours}", (f"transformer.h.{index - 1}.{theirs}",), None, t)
        for ours, theirs, t in _GPT2_BLOCK
    ]


def _llama_map(config: ModelConfig, index: int, tied: bool) -> list[HFTensor]:
    head = config.n_blocks - 1
    if index == 0:
        return [HFTensor("blocks.0.wte.weight", ("model.embed_tokens.weight",))]
    if index == head:
        lm = "model.embed_tokens.weight" if tied else None
        return [
            HFTensor(f"blocks.{head}.ln_f.weight", ("model.norm.weight",)),
            HFTensor(f"blocks.{head}.lm_head.weight", ("lm_head.weight",), fallback=lm),
        ]
    ours, theirs = f"blocks.{index}.", f"model.layers.{index - 1}."
    kv = config.kv_heads * config.head_dim
    attn = tuple(f"{theirs}self_attn.{p}_proj" for p in "qkv")
    mlp = (f"{theirs}mlp.gate_proj", f"{theirs}mlp.up_proj")
    qkv_rows, fc_rows = (config.n_embd, kv, kv), (config.mlp_width,) * 2
    out = [
        HFTensor(f"{ours}ln_1.weight", (f"{theirs}input_layernorm.weight",)),
        HFTensor(f"{ours}ln_2.weight", (f"{theirs}post_attention_layernorm.weight",)),
        HFTensor(f"{ours}attn.qkv.weight", tuple(f"{n}.weight" for n in attn), qkv_rows),
        HFTensor(f"{ours}attn.proj.weight", (f"{theirs}self_attn.o_proj.weight",)),
        HFTensor(f"{ours}mlp.fc.weight", tuple(f"{n}.weight" for n in mlp), fc_rows),
        HFTensor(f"{ours}mlp.proj.weight", (f"{theirs}mlp.down_proj.weight",)),
    ]
    if config.bias:
        out += [
            HFTensor(f"{ours}attn.qkv.bias", tuple(f"{n}.bias" for n in attn), qkv_rows),
            HFTensor(f"{ours}attn.proj.bias", (f"{theirs}self_attn.o_proj.bias",)),
            HFTensor(f"{ours}mlp.fc.bias", tuple(f"{n}.bias" for n in mlp), fc_rows),
            HFTensor(f"{ours}mlp.proj.bias", (f"{theirs}mlp.down_proj.bias",)),
        ]
    return out


def tensor_map(config: ModelConfig, blocks: range, *, tied: bool = False) -> list[HFTensor]:
    """Every tensor of ``blocks`` (indices of ``config``'s blocks) in Hugging Face's names.
    ``tied``: the checkpoint ties its head to the embedding (the head may read it there)."""
    block_map = _llama_map if config.family == "llama" else _gpt2_map
    return [t for i in blocks for t in block_map(config, i, tied)]


def hf_config(config: ModelConfig) -> dict:
    """``config.json`` of ``config`` for ``transformers`` (``GPT2LMHeadModel`` or
    ``LlamaForCausalLM``), with our own settings under ``swarmtrain`` (so the directory
    loads back into the same ``ModelConfig``). ``ValueError`` for a model the format cannot
    hold."""
    if config.tie_embeddings:
        raise ValueError("tied embeddings are not exported: set tie_embeddings=False")
    if config.family == "llama":
        meta = {
            "architectures": [LLAMA],
            "model_type": "llama",
            "vocab_size": config.vocab_size,
            "hidden_size": config.n_embd,
            "intermediate_size": config.mlp_width,
            "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.block_size,
            "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta,
            "rope_scaling": _rope_scaling_json(config.rope_scaling),
            "attention_bias": config.bias,
            "mlp_bias": config.bias,
            "attention_dropout": config.dropout,
        }
    else:
        if not config.bias:
            raise ValueError("GPT-2 has biases in every layer: a model with bias=False has none")
        meta = {
            "architectures": [GPT2],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.block_size,
            "n_ctx": config.block_size,
            "n_embd": config.n_embd,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.mlp_width,
            # "gelu" is exact GELU (F.gelu); "gelu_new" GPT-2's tanh approximation
            "activation_function": "gelu_new" if config.activation == "gelu_tanh" else "gelu",
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.dropout,
            "layer_norm_epsilon": config.norm_eps,
            "scale_attn_weights": True,
        }
    return meta | {
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
        "swarmtrain": config.to_dict(),
    }


def model_config(meta: Mapping, source: str) -> tuple[ModelConfig, bool]:
    """The ``ModelConfig`` of a Hugging Face ``config.json`` (``meta``, read from
    ``source``, which errors name), and whether the checkpoint ties its head to its
    embedding (the model built untied: a tied model cannot be cut into stages; both
    start from the same tensor). ``ValueError``, one line naming ``source``, for an
    unsupported architecture or setting."""
    archs = meta.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ValueError(
            f"{source}: architecture {', '.join(map(str, archs)) or 'unknown'} is not "
            f"supported; supported: {', '.join(SUPPORTED)}"
        )

    def unsupported(setting: str, value, want) -> ValueError:
        return ValueError(f"{source}: {setting}={value!r} is not supported ({arch} needs {want})")

    try:
        if arch == LLAMA:
            fields = _llama_fields(meta, unsupported)
        else:
            fields = _gpt2_fields(meta, unsupported)
        tied = bool(meta.get("tie_word_embeddings", arch == GPT2))
        return ModelConfig(**fields), tied
    except KeyError as e:
        raise ValueError(f"{source}: {arch} config lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if str(e).startswith(source):
            raise
        raise ValueError(f"{source}: {e}") from None


def _llama_fields(meta: Mapping, unsupported) -> dict:
    hidden, heads = meta["hidden_size"], meta["num_attention_heads"]
    if meta.get("hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", meta["hidden_act"], "silu")
    rope_scaling = _rope_scaling(meta.get("rope_scaling"), unsupported)
    if meta.get("pretraining_tp", 1) != 1:
        raise unsupported("pretraining_tp", meta["pretraining_tp"], "1")
    if meta.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise ValueError(
            f"hidden_size ({hidden}) must be num_attention_heads ({heads}) x head_dim "
            f"({meta.get('head_dim', 'unset')})"
        )
    bias = meta.get("attention_bias", False)
    if meta.get("mlp_bias", False) != bias:
        raise unsupported("mlp_bias", meta.get("mlp_bias", False), f"attention_bias ({bias})")
    return {
        "family": "llama",
        "vocab_size": meta["vocab_size"],
        "block_size": min(meta.get("max_position_embeddings", 2048), MAX_PRETRAINED_BLOCK_SIZE),
        "n_layer": meta["num_hidden_layers"],
        "n_head": heads,
        "n_kv_head": meta.get("num_key_value_heads") or heads,
        "n_embd": hidden,
        "intermediate_size": meta["intermediate_size"],
        "norm_eps": meta.get("rms_norm_eps", 1e-6),
        "rope_theta": float(meta.get("rope_theta", 10000.0)),
        "rope_scaling": rope_scaling,
        "bias": bool(bias),
        "dropout": 0.0,  # 0 keeps forward passes reproducible (a stage recomputes them)
    }


# ``rope_scaling`` of type llama3 in ``config.json``, in ``ModelConfig.rope_scaling``'s order.
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling_json(values: tuple[float, float, float, int] | None) -> dict | None:
    if values is None:
        return None
    return {"rope_type": "llama3", **dict(zip(_LLAMA3_KEYS, values, strict=True))}


def _rope_scaling(scaling, unsupported) -> tuple[float, float, float, int] | None:
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if not scaling or kind == "default":
        return None
    if kind != "llama3":
        raise unsupported("rope_scaling", scaling, "none or rope_type 'llama3'")
    factor, low, high, original = (scaling[k] for k in _LLAMA3_KEYS)
    return float(factor), float(low), float(high), int(original)


_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def _gpt2_fields(meta: Mapping, unsupported) -> dict:
    act = meta.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise unsupported("activation_function", act, " or ".join(_GPT2_ACTIVATIONS))
    if not meta.get("scale_attn_weights", True):
        raise unsupported("scale_attn_weights", False, "True")
    if meta.get("scale_attn_by_inverse_layer_idx", False):
        raise unsupported("scale_attn_by_inverse_layer_idx", True, "False")
    return {
        "family": "gpt",
        "vocab_size": meta["vocab_size"],
        "block_size": meta.get("n_positions", 1024),
        "n_layer": meta["n_layer"],
        "n_head": meta["n_head"],
        "n_embd": meta["n_embd"],
        "intermediate_size": meta.get("n_inner"),
        "norm_eps": meta.get("layer_norm_epsilon", 1e-5),
        "activation": _GPT2_ACTIVATIONS[act],
        "bias": True,
        "dropout": 0.0,  # 0 keeps forward passes reproducible (a stage recomputes them)
    }
