"""Reading a recipe file: UTF-8 text, YAML without duplicate keys.

Why not plain ``yaml.safe_load``: PyYAML keeps the last of two equal keys, so a
recipe that sets ``learning_rate`` twice trains with whichever comes second and
says nothing. A recipe is also read as bytes and decoded here, so a file in
another encoding is one clear error instead of a ``UnicodeDecodeError``
traceback.
"""

from __future__ import annotations

from typing import Any

import yaml

from neutrain.errors import RecipeError


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first_line: int, second_line: int):
        super().__init__(key, first_line, second_line)
        self.key, self.first_line, self.second_line = key, first_line, second_line


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (merge keys ``<<`` excepted)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` then overriding a key of base is how YAML merges are meant to be used
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable (list) key: SafeLoader refuses it itself
                    continue
                if first != key_node.start_mark.line + 1:
                    raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


def parse_recipe_text(data: bytes, name: str) -> Any:
    """Decode ``data`` as UTF-8 and parse it as YAML, refusing duplicate keys.

    Args:
        data: The recipe file's bytes.
        name: The file name, for messages.

    Raises:
        RecipeError: for non-UTF-8 bytes (naming the offset), invalid YAML (naming line and
            column) or a key given twice in one mapping (naming the key and both lines).

    Example:
        >>> parse_recipe_text(b"train:\\n  max_steps: 3\\n", "r.yaml")
        {'train': {'max_steps': 3}}
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise RecipeError(f"{name}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}, offset {exc.start}); "
                          "save the recipe as UTF-8") from None
    try:
        return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as exc:
        raise RecipeError(f"{name}: key '{exc.key}' appears twice (lines {exc.first_line} and {exc.second_line}); "
                          "YAML would silently keep the second, remove one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"{name}:{at} is not valid YAML ({getattr(exc, 'problem', exc)})") from None
