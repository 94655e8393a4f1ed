"""Export for inference: dense Hugging Face folders (and NeuZip formats as they land).

Example:
    >>> from neutrain.export import export_model
    >>> export_model(model, "outputs/run/export", "hf", tokenizer=tokenizer)
"""

from __future__ import annotations

from neutrain.config.errors import UserInputError
from neutrain.export.hf import export_hf, load_checkpoint_model

FORMATS = ("hf",)


def export_model(model, output_dir, fmt: str = "hf", tokenizer=None, **kwargs) -> str:
    """Export ``model`` in format ``fmt`` (see :data:`FORMATS`); returns the directory."""
    if fmt == "hf":
        return export_hf(model, output_dir, tokenizer=tokenizer, **kwargs)
    raise UserInputError(f"export format '{fmt}' is not available (available: {', '.join(FORMATS)})")


__all__ = ["FORMATS", "export_hf", "export_model", "load_checkpoint_model"]
