"""Export for inference: dense Hugging Face folders and NeuZip-compressed ones.

Formats: ``hf`` (dense safetensors, loads anywhere), ``neuzip`` (lossless
NeuZip, bit-exact) and ``neuzip-lossy-<k>`` (k mantissa bits). NeuZip exports
load compressed through ``AutoModelForCausalLM.from_pretrained`` after
``import neutrain`` (:mod:`neutrain.export.quantizer`). A PEFT model is merged
first (:func:`neutrain.export.lora.merge_lora`).

Submodules are imported on first use, so that ``import neutrain`` (which
imports :mod:`neutrain.export.registration`) stays light.

Example:
    >>> from neutrain.export import export_model
    >>> export_model(model, "outputs/run/export", "neuzip-lossy-3", tokenizer=tokenizer)  # doctest: +SKIP
"""

from __future__ import annotations

import re

from neutrain.errors import UserInputError
from neutrain.storage.leftovers import clean_export_leftovers

FORMATS = ("hf", "neuzip", "neuzip-lossless", "neuzip-lossy-<k>")
LOSSY_KS = (0, 1, 3, 7)
"""The k of ``neuzip-lossy-<k>``: :data:`neutrain.compress.layout.LOSSY_MANTISSA_BITS`, named here without
importing the codec, so a bad ``--format`` is refused before anything heavy loads."""


def check_format(fmt: str) -> None:
    """Refuse an export format that is not one of :data:`FORMATS` (a lossy k the codec does not offer too).

    Example:
        >>> check_format("neuzip-lossy-5")
        Traceback (most recent call last):
        neutrain.errors.UserInputError: export format 'neuzip-lossy-5' is not available (available: hf, neuzip, neuzip-lossless, neuzip-lossy-<k>; k = 0, 1, 3 or 7)
    """
    match = re.fullmatch(r"neuzip(?:-lossless|-lossy-(\d+))?", fmt or "")
    if fmt != "hf" and (match is None or (match.group(1) is not None and int(match.group(1)) not in LOSSY_KS)):
        raise UserInputError(f"export format '{fmt}' is not available (available: {', '.join(FORMATS)}; "
                             f"k = {', '.join(map(str, LOSSY_KS[:-1]))} or {LOSSY_KS[-1]})")


def export_model(model, output_dir, fmt: str = "hf", tokenizer=None, **kwargs) -> str:
    """Export ``model`` in format ``fmt`` (see :data:`FORMATS`); returns the directory.

    ``output_dir`` is written atomically and never replaces anything but a previous neutrain export,
    and that only with ``overwrite=True`` (:mod:`neutrain.export.target`); other keyword arguments go to
    :func:`export_hf` or :func:`export_neuzip`.
    """
    check_format(fmt)
    from neutrain.export.lora import merge_lora  # lazy: keeps `import neutrain` light
    from neutrain.nn.lora import is_peft_model  # lazy: keeps `import neutrain` light

    if is_peft_model(model):
        # Merged densely: the NeuZip export below compresses the merged weights at its own k.
        model = merge_lora(model, "dense")
    from neutrain.storage.run_dir import claim  # lazy: keeps `import neutrain` light

    clean_export_leftovers(output_dir)  # of an earlier export killed or failed beside output_dir
    claim(output_dir)  # inside a run's directory: listed as the run's (neutrain.storage.run_dir)
    try:
        if fmt == "hf":
            from neutrain.export.hf import export_hf  # lazy: keeps `import neutrain` light

            return export_hf(model, output_dir, tokenizer=tokenizer, **kwargs)
        from neutrain.export.neuzip import export_neuzip, parse_format  # lazy: keeps `import neutrain` light

        kwargs.pop("dtype", None)  # NeuZip keeps the weights' own dtype
        return export_neuzip(model, output_dir, mantissa_bits=parse_format(fmt), tokenizer=tokenizer, **kwargs)
    except BaseException:
        # A failed export (full disk, bad shard size, interrupt) removes its half-written directory and puts
        # back a previous export it had moved aside.
        clean_export_leftovers(output_dir)
        raise


def __getattr__(name):
    if name in ("export_hf", "load_checkpoint_model", "densify"):
        from neutrain.export import hf  # lazy: keeps `import neutrain` light

        return getattr(hf, name)
    if name == "export_neuzip":
        from neutrain.export.neuzip import export_neuzip  # lazy: keeps `import neutrain` light

        return export_neuzip
    raise AttributeError(f"module 'neutrain.export' has no attribute {name!r}")


__all__ = ["FORMATS", "export_hf", "export_model", "export_neuzip", "load_checkpoint_model"]
