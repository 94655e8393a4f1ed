"""Reading a recipe file: text (UTF-8, or UTF-16/32 by its byte-order mark), YAML without duplicate keys.

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
from neutrain.files import decode_text


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
    """Decode ``data`` (:func:`neutrain.files.decode_text`) and parse it as YAML, refusing duplicate keys.

    Args:
        data: The recipe file's bytes.
        name: The file name, for messages.

    Raises:
        RecipeError: for bytes that are not text (naming the line and offset), invalid YAML (naming line and
            column) or a key given twice in one mapping (naming the key and both lines).

    Example:
        >>> parse_recipe_text(b"train:\\n  max_steps: 3\\n", "r.yaml")
        {'train': {'max_steps': 3}}
    """
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{name}: {len(data):,} bytes, more than a recipe's bound of {MAX_RECIPE_BYTES >> 20} MiB "
                          "(recipes are a few KiB; data goes in data files)")
    text = decode_text(data, name, RecipeError)  # UTF-8, or UTF-16/32 by its byte-order mark
    try:
        return _load_bounded(text, name)
    except RecursionError:
        raise RecipeError(f"{name}: nests too deep to read (YAML nesting beyond Python's recursion limit)") from None
    except _DuplicateKey as exc:
        raise RecipeError(f"{name}: key '{exc.key}' appears twice (lines {exc.first_line} and {exc.second_line}); "
                          "YAML would silently keep the second, remove one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # PyYAML's reader folds its text
        raise RecipeError(f"{name}:{at} is not valid YAML ({problem})") from None


MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_VALUES = 100_000
"""A recipe holds a few hundred values; aliases (``*name``) may repeat parts of it, but not explode it."""


def _load_bounded(text: str, name: str) -> Any:
    """Parse with :class:`StrictSafeLoader`, refusing a document whose aliases expand past :data:`MAX_RECIPE_VALUES`.

    Why: PyYAML builds an alias bomb (``a: &a [x, x]``, ``b: &b [*a, *a]``, ... nine levels) cheaply, as shared
    references, but every later walk of the recipe (validation, ``recipe.yaml`` in the run directory) expands
    it: a "billion laughs" recipe hung in the first save.
    """
    loader = StrictSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_values(node, name) > MAX_RECIPE_VALUES:
            raise RecipeError(f"{name}: its YAML aliases expand to more than {MAX_RECIPE_VALUES:,} values (an alias "
                              "bomb?); a recipe holds a few hundred")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_values(root: yaml.Node, name: str) -> int:
    """How many nodes ``root`` has with every alias expanded (counted once per shared node, without expanding)."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        if not children_done:
            if id(node) in open_nodes:
                raise RecipeError(f"{name}: a YAML alias refers to a node that contains it (a recursive structure)")
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in size)
            continue
        open_nodes.discard(id(node))
        if any(id(c) not in size for c in children):
            raise RecipeError(f"{name}: a YAML alias refers to a node that contains it (a recursive structure)")
        size[id(node)] = min(1 + sum(size[id(c)] for c in children), MAX_RECIPE_VALUES + 1)
    return size[id(root)]
