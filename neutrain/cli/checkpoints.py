"""Which directory a command means: a checkpoint or export itself, or a run's last checkpoint."""

from __future__ import annotations

from pathlib import Path

from neutrain.errors import UserInputError


def last_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint or export, else the last ``checkpoint-N`` inside it.

    Example:
        >>> last_checkpoint(Path("outputs/default"))  # doctest: +SKIP
        PosixPath('outputs/default/checkpoint-60')
    """
    from transformers.trainer_utils import get_last_checkpoint  # lazy: `neutrain --help` stays instant

    if not path.exists():
        raise UserInputError(f"checkpoint '{path}' does not exist")
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return path
    if path.is_dir():
        last = get_last_checkpoint(str(path))
        if last:
            return Path(last)
    raise UserInputError(f"checkpoint '{path}': no config.json and no checkpoint-N inside")
