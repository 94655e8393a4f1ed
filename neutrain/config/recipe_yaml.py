"""Reading a recipe file: text (UTF-8, or UTF-16/32 by its byte-order mark), YAML without duplicate keys, holding
only what a recipe can hold.

Why not plain ``yaml.safe_load``: PyYAML keeps the last of two equal keys, so a recipe that sets ``learning_rate``
twice trains with whichever comes second and says nothing. Its YAML 1.1 scalars read numbers no other reader of
neutrain takes: ``1:30`` is 90 (base 60), ``010`` is 8 (octal), ``1_0`` is 10, ``0x10`` is 16, where every
numeric flag and ``NEUTRAIN_*`` variable takes ASCII decimal digits only; ``2024-01-01`` is a date, ``!!binary`` bytes
and ``!!set`` a set, which passed as a value of ``train.fsdp_config`` or ``model.config`` and failed in a
``TypeError`` traceback when the run wrote its config as JSON. Here a recipe's YAML reads as JSON's types only (text,
decimal numbers, booleans, null, lists, mappings), the same for a recipe file and a ``section.key=value`` override
(:func:`load_yaml`). A recipe is also read as bytes and decoded here, so a file in another encoding is one clear
error instead of a ``UnicodeDecodeError`` traceback.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from neutrain.errors import RecipeError
from neutrain.files import decode_text

_INT, _FLOAT, _MERGE = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:merge"
# Decimal only: no base-60 (``1:30``), binary, hexadecimal or ``_`` between digits, and ``010`` is ten. Each is a
# subset of YAML 1.1's own forms, so that a string the run writes back (``recipe.yaml``, by PyYAML's dumper, which
# quotes what YAML 1.1 reads as a number) reads back as the same string: ``1e-5`` (no dot) stays text, as there.
_DECIMAL_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*|0[0-7]+)$")
_DECIMAL_FLOAT = re.compile(r"^(?:[-+]?[0-9]+\.[0-9]*(?:[eE][-+][0-9]+)?|\.[0-9]+(?:[eE][-+][0-9]+)?"
                            r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_DIGITS = re.compile(r"^[-+]?[0-9]+$")
# Tags whose values JSON has no type for; a recipe, written again as JSON and YAML by the run, refuses them.
_REFUSED_TAGS = ("binary", "timestamp", "set", "omap", "pairs")
_OURS = ("the tag ", "'")  # how this loader's own refusals start: they are valid YAML, of no recipe's type


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` reading JSON's types only: plain scalars resolve to decimal numbers, booleans, null or
    text (a date stays text), and a tag of another type (``!!binary``, ``!!set``, ``!!timestamp``) is refused."""

    yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag not in
                                       (_INT, _FLOAT, "tag:yaml.org,2002:timestamp")]
                               for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_decimal_int(self, node):
        text = self.construct_scalar(node)
        if not _DIGITS.match(text):  # an explicit ``!!int`` takes any run of decimal digits
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer in decimal ASCII digits",
                                                    node.start_mark)
        return int(text, 10)

    def construct_decimal_float(self, node):
        text = self.construct_scalar(node)
        if not (_DECIMAL_FLOAT.match(text) or _DIGITS.match(text)):
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not a number in decimal ASCII digits",
                                                    node.start_mark)
        return yaml.SafeLoader.construct_yaml_float(self, node)

    def refuse_tag(self, node):
        raise yaml.constructor.ConstructorError(None, None, f"the tag {node.tag.replace('tag:yaml.org,2002:', '!!')} "
                                                "is not a recipe value (text, a number, a boolean, null, a list or a "
                                                "mapping)", node.start_mark)


RecipeLoader.add_implicit_resolver(_INT, _DECIMAL_INT, list("-+0123456789"))
RecipeLoader.add_implicit_resolver(_FLOAT, _DECIMAL_FLOAT, list("-+0123456789."))
RecipeLoader.add_constructor(_INT, RecipeLoader.construct_decimal_int)
RecipeLoader.add_constructor(_FLOAT, RecipeLoader.construct_decimal_float)
for _tag in _REFUSED_TAGS:
    RecipeLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", RecipeLoader.refuse_tag)


def parse_recipe_text(data: bytes, name: str) -> Any:
    """Decode ``data`` (:func:`neutrain.files.decode_text`) and parse it as YAML (:func:`load_yaml`).

    Args:
        data: The recipe file's bytes.
        name: The file name, for messages.

    Raises:
        RecipeError: for bytes that are not text (naming the line and offset), invalid YAML or a value of a
            type no recipe holds (naming line and column) or a key given twice in one mapping (naming the key
            and both lines).

    Example:
        >>> parse_recipe_text(b"train:\\n  max_steps: 3\\n", "r.yaml")
        {'train': {'max_steps': 3}}
        >>> parse_recipe_text(b"train: {max_steps: 3, max_steps: 5}\\n", "r.yaml")
        Traceback (most recent call last):
        neutrain.errors.RecipeError: r.yaml: key 'max_steps' appears twice (lines 1 and 1); YAML would silently keep the second, remove one
    """
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{name}: {len(data):,} bytes, more than a recipe's bound of {MAX_RECIPE_BYTES >> 20} MiB "
                          "(recipes are a few KiB; data goes in data files)")
    text = decode_text(data, name, RecipeError)  # UTF-8, or UTF-16/32 by its byte-order mark
    try:
        return load_yaml(text, name)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # PyYAML's reader folds its text
        if isinstance(exc, yaml.constructor.ConstructorError) and problem.startswith(_OURS):
            raise RecipeError(f"{name}:{at}: {problem}") from None
        raise RecipeError(f"{name}:{at} is not valid YAML ({problem})") from None


MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_VALUES = 100_000
"""A recipe holds a few hundred values; aliases (``*name``) may repeat parts of it, but not explode it."""


def load_yaml(text: str, name: str) -> Any:
    """``text`` parsed with :class:`RecipeLoader`: the one YAML reader of recipe files and override values.

    Refused as :class:`RecipeError` naming ``name``: a key given twice in one mapping (on two lines or one,
    ``{a: 1, a: 2}``), aliases expanding past :data:`MAX_RECIPE_VALUES` and nesting past Python's recursion limit.

    Why the bound: PyYAML builds an alias bomb (``a: &a [x, x]``, ``b: &b [*a, *a]``, ... nine levels) cheaply, as
    shared references, but every later walk of the recipe (validation, ``recipe.yaml`` in the run directory) expands
    it: a "billion laughs" recipe hung in the first save, and one given as an override hung the load.

    Raises:
        yaml.YAMLError: text that is not YAML, or a value of a type no recipe holds (the caller words it).
    """
    loader = RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_values(node, name) > MAX_RECIPE_VALUES:
            raise RecipeError(f"{name}: its YAML aliases expand to more than {MAX_RECIPE_VALUES:,} values (an alias "
                              "bomb?); a recipe holds a few hundred")
        _refuse_duplicate_keys(loader, node, name)
        return loader.construct_document(node)
    except RecursionError:
        raise RecipeError(f"{name}: nests too deep to read (YAML nesting beyond Python's recursion limit)") from None
    finally:
        loader.dispose()


def _refuse_duplicate_keys(loader: RecipeLoader, root: yaml.Node, name: str) -> None:
    """Refuse a mapping of the composed document that holds a key twice (merge keys ``<<`` excepted: overriding a
    merged key is what they are for). Checked on the nodes as written, before construction merges any."""
    done: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in done:
            continue
        done.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                stack.extend((key_node, value_node))
                if key_node.tag == _MERGE:
                    continue
                try:
                    key = loader.construct_object(key_node, deep=True)
                    first = seen.get(key)
                except (TypeError, yaml.YAMLError):
                    continue  # an unhashable (list) key or a refused tag: construction refuses it itself
                if first is not None:
                    raise RecipeError(f"{name}: key '{key}' appears twice (lines {first} and "
                                      f"{key_node.start_mark.line + 1}); YAML would silently keep the second, "
                                      "remove one")
                seen[key] = key_node.start_mark.line + 1


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
