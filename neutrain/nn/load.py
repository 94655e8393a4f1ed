"""Build a causal LM from any tensor source into any placement, one tensor at a time.

:func:`build` is the one build path: a :class:`~neutrain.nn.model_spec.ModelSpec` (source,
config, dtypes, attention, placement) becomes a skeleton with parameters on the meta device
(buffers such as rotary frequencies are real), and the source's ``(name, tensor)`` pairs
(:mod:`neutrain.nn.sources`, :class:`neutrain.nn.gguf.GGUFFile`) flow into one
:class:`~neutrain.nn.sink.ModelSink`, which makes them dense parameters, compressed modules, or
compressed modules whose decoder layers go to host memory as each is complete. A target weight is
encoded as soon as it arrives and its dense tensor dropped, so peak memory is the compressed model
plus one dense tensor, never the dense model.

``init_compressed`` (random weights, for shape-only runs and benchmarks) is this build for the simplest
source; :func:`neutrain.nn.formats.load_compressed` builds a saved folder, whatever its format.
"""

from __future__ import annotations

import torch

from neutrain.config.model_config import check_rotary_names
from neutrain.config.model_values import (
    ROTARY_KEYS, check_config_relations, check_config_values, check_generation_values,
)
from neutrain.errors import CheckpointError, RecipeError
from neutrain.nn.build_progress import build_progress
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.nn.sink import ModelSink
from neutrain.nn.sources import RandomInit


def build(spec: ModelSpec, *, progress: bool = True):
    """Build the model ``spec`` describes, tensor by tensor, in ``spec.placement``.

    Returns:
        ``(model, report)``: the model (train mode; with offload, its store is ``weight_store(model)``)
        and a :class:`~neutrain.nn.convert.CompressionReport`.

    Example:
        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> spec = ModelSpec(RandomInit(seed=0), cfg, torch.bfloat16, codec_options={"steps": 16},
        ...                  placement=Placement("neuzip-lossless", offload=True))
        >>> model, report = build(spec, progress=False)
        >>> type(model.model.layers[0].self_attn.q_proj).__name__, len(model._neutrain_weight_offload.layers)
        ('CompressedLinear', 2)
    """
    label = getattr(spec.source, "label", None)  # a file's: its values are checked as a recipe's are at load
    where, error = (f"{label}: config", CheckpointError) if label is not None else ("model.config", RecipeError)
    if label is not None:
        check_config_values(spec.config.to_dict(), where, error)
    else:  # the recipe's values were checked at load; these relations hold only with the class's defaults filled in
        check_config_relations(spec.config.to_dict(), where, error)
    check_config_names(spec.config, where, error)
    if spec.attention is not None:
        spec.config._attn_implementation = spec.attention
    model = _skeleton(spec.config, spec.dtype, spec.trust_remote_code, where, error)
    sink = ModelSink(model, spec.placement, storage_dtype=spec.storage_dtype, codec_options=spec.codec_options,
                     source_keys=spec.source.keys(), label=label or "model.config's model")
    count = getattr(spec.source, "tensor_count", None)
    for name, tensor in build_progress(spec.source.tensors(model, spec.placement.device, spec.dtype), "loading weights",
                                       count() if count else None, progress):
        if label is not None and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            check_finite(label, name, tensor)
        sink.put(name, tensor)
        del tensor  # before the source reads the next one
    model, report = sink.finish()
    generation = spec.source.generation_config()
    if generation is not None:
        # Merged into every model.generate (the sample after a run, a model no engine serves): held to its rules here,
        # where it was taken whole and a bad value failed inside a generation after the training.
        check_generation_values(generation.to_dict(), f"{label or 'model'}: generation_config.json", error,
                                getattr(spec.config, "vocab_size", None))
        model.generation_config = generation
    return model, report


_ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function")


def check_config_names(config, where: str, error: type[Exception]) -> None:
    """Refuse an activation or a rotary-scaling type that transformers has no function for.

    Why here: the names are the keys of transformers' own tables (``ACT2FN``, ``ROPE_INIT_FUNCTIONS``), which
    import torch, so the recipe check (torch-free) cannot hold them; a name missing from them raised a bare
    ``KeyError`` from inside the model's constructor. This runs before the skeleton is made, for every build.

    Example:
        >>> from transformers import LlamaConfig
        >>> check_config_names(LlamaConfig(hidden_act="banana"), "model.config", ValueError)
        Traceback (most recent call last):
        ValueError: model.config.hidden_act: 'banana' is not an activation transformers has (one of gelu, ...)
    """
    from transformers.activations import ACT2FN

    for key in _ACTIVATION_KEYS:
        name = getattr(config, key, None)
        if isinstance(name, str) and name not in ACT2FN:
            raise error(f"{where}.{key}: {name!r} is not an activation transformers has (one of "
                        f"{', '.join(sorted(ACT2FN))})")
    check_rotary_names({key: getattr(config, key, None) for key in ROTARY_KEYS}, where, list(ROTARY_KEYS), error)


def check_finite(label: str, name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor holding NaN or inf, naming the file, the tensor and the first such element.

    Why: a NaN in a foreign export's norm weight made every logit NaN, and ``generate`` printed a blank line
    with exit 0. One reduction decides (a NaN or inf makes the fp32 sum non-finite); only a tensor whose sum
    is not finite, or overflows, is searched element by element.

    Example:
        >>> check_finite("model 'm'", "model.norm.weight", torch.tensor([1.0, float("nan")]))
        Traceback (most recent call last):
        neutrain.errors.CheckpointError: model 'm': tensor 'model.norm.weight' holds 1 NaN or infinite value(s) (the first nan, at index 1); the file is corrupt or was saved from a diverged model
    """
    if torch.isfinite(tensor.sum(dtype=torch.float32)):
        return
    bad = ~torch.isfinite(tensor)
    count = int(bad.sum())
    if count:
        first = int(bad.flatten().nonzero()[0])
        raise CheckpointError(f"{label}: tensor '{name}' holds {count} NaN or infinite value(s) (the first "
                              f"{tensor.flatten()[first].item()}, at index {first}); the file is corrupt or was saved "
                              "from a diverged model")


def init_compressed(
    config,
    weights: str = "neuzip-lossless",
    device: str | torch.device = "cuda",
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    progress: bool = True,
    codec_options: dict | None = None,
    storage_dtype: torch.dtype | None = None,
):
    """A randomly initialised causal LM built tensor by tensor into compressed form.

    Matrices are drawn from ``N(0, config.initializer_range)`` (transformers'
    default for Llama-style models), norm weights are ones and biases zeros
    (:class:`neutrain.nn.sources.RandomInit`). ``storage_dtype`` as for :func:`neutrain.nn.formats.load_compressed`.

    Returns:
        ``(model, report)`` as :func:`neutrain.nn.formats.load_compressed`.
    """
    spec = ModelSpec(RandomInit(seed), config, dtype, storage_dtype, placement=Placement(weights, device=device),
                     codec_options=codec_options)
    return build(spec, progress=progress)


def _skeleton(config, dtype: torch.dtype, trust_remote_code: bool = False, where: str = "model.config",
              error: type[Exception] = RecipeError):
    """``config``'s model on the meta device: the one place every config the build or the memory plan uses is
    built. Why the guard: a value each rule lets through can still break the architecture's own code
    (``head_dim: 0`` divided by zero in Llama's rotary init), which ended in that code's traceback; it is one
    line naming the config and the architecture's own words instead."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from neutrain.errors import UserInputError

    try:
        with init_empty_weights(include_buffers=False):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    except UserInputError:
        raise
    except (ArithmeticError, ValueError, TypeError, IndexError, KeyError, AssertionError, RuntimeError) as exc:
        if isinstance(exc, (NotImplementedError, RecursionError)):
            raise
        model_type = getattr(config, "model_type", None) or type(config).__name__
        raise error(f"{where}: the {model_type} architecture cannot be built from these values "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'})") from exc


def parameter_shapes(config, trust_remote_code: bool = False) -> list[tuple[str, tuple[int, ...], int]]:
    """``(name, shape, bytes per element at bf16 compute)`` of every parameter the build gives ``config``'s
    model, read from its skeleton on the meta device (no memory, no weights): each architecture's own modules,
    MoE expert stacks included, a tied head once. The memory planner reads a model's size from here, so it
    counts what the build allocates."""
    model = _skeleton(config, torch.bfloat16, trust_remote_code)
    head = model.get_output_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None:
        head.weight = model.get_input_embeddings().weight  # as the sink ties them (neutrain.nn.sink)
    # An architecture may keep a tensor in fp32 whatever the compute dtype (DeepSeek V3's router): 4 bytes, not 2.
    return [(name, tuple(param.shape), param.element_size()) for name, param in model.named_parameters()]
