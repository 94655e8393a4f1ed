"""The one reader of the files a user names: a recipe, a JSON config, a chat template, a tokenizer file.

Why one reader: each of these used to be opened in its own way, and each way had its own hole. A FIFO
given as a recipe was reported as missing ("does not exist"), as a ``train.fsdp_config`` it blocked the run
forever; ``/dev/zero`` read until memory ran out or was called "a directory"; a file in another encoding
ended in a ``UnicodeDecodeError`` traceback. Here every such file goes through the same steps:

* its kind is checked before it is opened (:func:`check_kind`): a missing path, a directory, a FIFO, a
  character or block device and a socket each get their own word;
* it is opened without blocking and checked again on the open descriptor (a path swapped for a FIFO
  between the two cannot hang the read), then read up to a bound of bytes (:func:`read_bytes`);
* its encoding is detected (:func:`decode_text`): UTF-8, or UTF-16/32 with a byte-order mark; anything
  else names the line and the byte offset where it stops being text;
* a JSON file's parse error names the line and column, and a string holding a lone surrogate (a ``\\ud800``
  escape that no character follows up) names the key it sits under (:func:`parse_json`).

Each failure is one line, raised as the caller's error class (this module imports nothing of neutrain's,
so every layer may use it: a :class:`~neutrain.errors.RecipeError` for
a recipe key, a :class:`~neutrain.errors.DataError` for data), starting with the caller's ``label``,
which names the key or the file. Data files themselves are read by ``datasets``; their scan before it
(``neutrain.data.bounds``) takes its kinds and encoding rules from here.

Example:
    >>> from neutrain.errors import RecipeError
    >>> try:
    ...     read_bytes("/dev/zero", "train.fsdp_config: file '/dev/zero'", 1 << 20, RecipeError)
    ... except RecipeError as exc:
    ...     print(exc)
    train.fsdp_config: file '/dev/zero' is a character device, not a regular file
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import stat
from typing import Any

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_word(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a regular file"``, ``"a FIFO (named pipe)"``, ...).

    Example:
        >>> kind_word(os.stat("/dev/null").st_mode), kind_word(os.stat("/").st_mode)
        ('a character device', 'a directory')
    """
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((word for test, word in _KINDS if test(mode)), "a special file")


def nearest_existing(path: str | os.PathLike) -> str:
    """The nearest folder at or above ``path`` (made absolute) that exists; a name too long to look up counts
    as absent, so this never raises ``ENAMETOOLONG``."""
    existing = os.path.abspath(path)
    while os.path.dirname(existing) != existing:
        try:
            os.stat(existing)
            break
        except OSError:  # missing, or ENAMETOOLONG: the very thing a caller may be measuring
            existing = os.path.dirname(existing)
    return existing


def _pathconf(path: str, name: str, default: int) -> int:
    try:
        return os.pathconf(nearest_existing(path), name)
    except (OSError, ValueError):
        return default


def path_too_long(path: str | os.PathLike) -> str | None:
    """Why the file system under ``path`` cannot hold it, or None: a name past its ``NAME_MAX`` or the whole
    (absolute) path past its ``PATH_MAX``, measured in bytes where the path would be created.

    Why before any use: such a path cannot even be looked up (``stat`` raises ``ENAMETOOLONG``), so the
    first check that touched it failed as a bare "File name too long" naming neither the key nor the fix.

    Example:
        >>> path_too_long("/tmp/" + "x" * 300)[:40]
        "its name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
        >>> path_too_long("/tmp/run") is None
        True
    """
    whole = os.path.abspath(path)
    name_max, path_max = _pathconf(whole, "PC_NAME_MAX", 255), _pathconf(whole, "PC_PATH_MAX", 4096)
    for part in whole.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            return (f"its name '{part[:30]}...' has {len(os.fsencode(part))} bytes, more than the {name_max} a name "
                    "may have there (NAME_MAX)")
    if len(os.fsencode(whole)) >= path_max:
        return (f"it is a path of {len(os.fsencode(whole))} bytes ('{whole[:40]}...'), more than the {path_max} a "
                "path may have there (PATH_MAX)")
    return None


def not_text(value: str) -> str | None:
    """Why ``value`` (a path or a setting) is not text that can be written as UTF-8, or None.

    Why: a file name holding a byte that is not UTF-8 (``$'\\xff'`` on the command line) reaches Python as a
    lone surrogate; the file system takes it back, but the tokenizer's writer, a JSON record and a YAML recipe
    do not, and the run failed in a ``UnicodeEncodeError`` traceback after loading the model.

    Example:
        >>> not_text("/tmp/run") is None, not_text("/tmp/r\\udcff")
        (True, "'\\\\udcff' is a byte that is not UTF-8 text (or a lone surrogate)")
    """
    try:
        value.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return f"{value[exc.start]!r} is a byte that is not UTF-8 text (or a lone surrogate)"


def folder_kind_trouble(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a folder a command writes in, or None: it, or the nearest existing path above it, is
    a FIFO, a device or a socket. A regular file in the way is left to the write check (an environment failure).

    Why: ``train.output_dir: /dev/null`` or a FIFO there was "not writable (...): Not a directory", exit 1, as if the
    disk were at fault, and ``export --output FIFO`` called it "a file".

    Example:
        >>> folder_kind_trouble("/dev/null")
        'is a character device, not a directory'
        >>> folder_kind_trouble("/dev/null/run")
        "lies under '/dev/null', which is a character device, not a directory"
    """
    target = part = os.path.abspath(path)
    while True:
        try:
            mode = os.stat(part).st_mode
        except (FileNotFoundError, NotADirectoryError):
            if os.path.dirname(part) == part:
                return None
            part = os.path.dirname(part)
            continue
        except OSError:
            return None  # another failure (a loop, a permission): the folder's own checks name it
        if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
            return None
        if part == target:
            return f"is {kind_word(mode)}, not a directory"
        return f"lies under '{part}', which is {kind_word(mode)}, not a directory"


def link_trouble(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be reached through its symbolic links, or None: a loop, or a link (itself or a folder
    above it) to a missing path.

    Why for a folder a command creates: creating through a dangling link made its target, a folder the user
    never named (a link left to ``/nonexistent`` trained a whole run there), and a loop failed as a bare
    "Too many levels of symbolic links" naming neither the key nor the link.

    Example:
        >>> link_trouble("/tmp") is None
        True
    """
    try:
        os.stat(path)
        return None
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "passes through a loop of symbolic links"
        return None  # another failure: the folder's own checks name it
    part = os.path.abspath(path)
    while os.path.dirname(part) != part:
        if os.path.islink(part) and not os.path.exists(part):
            named = "is" if part == os.path.abspath(path) else f"passes through '{part}', which is"
            return (f"{named} a symbolic link to the missing path '{os.readlink(part)}'; a folder is not created "
                    "through a link: create its target first, or name the folder itself")
        part = os.path.dirname(part)
    return None


def check_kind(path: str | os.PathLike, label: str, error: type[Exception],
               want: str = "file") -> os.stat_result:
    """The ``stat`` of ``path``, refused unless it is what ``want`` says: ``"file"`` (a regular file),
    ``"dir"`` (a directory) or ``"any"`` (either). Nothing is opened, so a FIFO cannot block here.

    Raises:
        error: ``"<label> does not exist"``, or ``"<label> is <kind>, not <wanted>"``.

    Example:
        >>> from neutrain.errors import RecipeError
        >>> check_kind("/", "model.config: file '/'", RecipeError)
        Traceback (most recent call last):
        neutrain.errors.RecipeError: model.config: file '/' is a directory, not a regular file
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        dangling = os.path.islink(path)
        raise error(f"{label} does not exist" + (" (it is a symbolic link to a missing path)" if dangling else "")) \
            from None
    except NotADirectoryError:
        raise error(f"{label} does not exist (a part of the path is a file, not a directory)") from None
    except OSError as exc:
        raise error(f"{label} cannot be read ({exc.strerror or exc})") from None
    mode = info.st_mode
    regular, folder = stat.S_ISREG(mode), stat.S_ISDIR(mode)
    if (want == "file" and not regular) or (want == "dir" and not folder) or (want == "any" and not (regular or folder)):
        wanted = {"file": "a regular file", "dir": "a directory", "any": "a regular file or a directory"}[want]
        raise error(f"{label} is {kind_word(mode)}, not {wanted}")
    return info


def read_bytes(path: str | os.PathLike, label: str, limit: int, error: type[Exception]) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (more is refused, not cut).

    The kind is checked before the file is opened and again on the open descriptor, and the open does not
    block (``O_NONBLOCK``), so a path that is, or becomes, a FIFO or a device is refused, never read.

    Raises:
        error: one line starting with ``label``: the kind, the size over ``limit``, or the read's failure.
    """
    info = check_kind(path, label, error)
    if info.st_size > limit:
        raise error(f"{label} is {info.st_size:,} bytes, more than the {_size(limit)} such a file may hold")
    data = _read_regular(path, label, limit, error, tail=False)[0]
    if len(data) > limit:  # grew while it was read
        raise error(f"{label} holds more than the {_size(limit)} such a file may hold")
    return data


def read_tail(path: str | os.PathLike, label: str, limit: int, error: type[Exception]) -> tuple[bytes, int]:
    """The last ``limit`` bytes (at most) of the regular file ``path``, and the offset they start at (0: the
    whole file). Checked as :func:`read_bytes` checks it; for a log that only grows, whose latest part is what
    its reader wants, so that a long one is cut rather than refused.

    Raises:
        error: one line starting with ``label``: the kind or the read's failure.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "log")
        >>> _ = open(path, "wb").write(b"a\\nbb\\nccc\\n")
        >>> read_tail(path, "log", 5, ValueError)
        (b'\\nccc\\n', 4)
    """
    check_kind(path, label, error)
    return _read_regular(path, label, limit, error, tail=True)


def _read_regular(path: str | os.PathLike, label: str, limit: int, error: type[Exception],
                  tail: bool) -> tuple[bytes, int]:
    """Up to ``limit + 1`` bytes of ``path`` from its start, or its last ``limit`` when ``tail``, with their offset;
    opened without blocking and refused unless the open descriptor is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{label} cannot be opened ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped since it was checked
            raise error(f"{label} is {kind_word(info.st_mode)}, not a regular file")
        start = max(0, info.st_size - limit) if tail else 0
        want = limit if tail else limit + 1
        chunks, total = [], 0
        while total < want:
            chunk = os.pread(fd, min(1 << 20, want - total), start + total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise error(f"{label} cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    return b"".join(chunks), start


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes"


# Byte-order marks, longest first (UTF-32-LE's starts with UTF-16-LE's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def detect_encoding(head: bytes) -> str:
    """The encoding a file starting with ``head`` is read in: its byte-order mark's, else ``utf-8``.

    Example:
        >>> detect_encoding(codecs.BOM_UTF16_LE + b"{"), detect_encoding(b"{}")
        ('utf-16', 'utf-8')
    """
    return next((name for bom, name in _BOMS if head.startswith(bom)), "utf-8")


def decode_text(data: bytes, label: str, error: type[Exception]) -> str:
    """``data`` as text in its detected encoding (:func:`detect_encoding`); a NUL byte is refused as binary.

    Raises:
        error: naming the line and byte offset where the bytes stop being text in that encoding.

    Example:
        >>> decode_text(codecs.BOM_UTF16_LE + "a: 1".encode("utf-16-le"), "r.yaml", ValueError)
        'a: 1'
        >>> decode_text(b"a: caf\\xe9\\n", "r.yaml", ValueError)
        Traceback (most recent call last):
        ValueError: r.yaml is not UTF-8 text (byte 0xe9 at line 1, offset 6); save it as UTF-8
    """
    encoding = detect_encoding(data[:4])
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        where = f"byte 0x{data[exc.start]:02x} at line {line}, offset {exc.start}"
        if encoding.startswith("utf-8"):
            raise error(f"{label} is not UTF-8 text ({where}); save it as UTF-8") from None
        raise error(f"{label} starts with a {encoding.upper()} byte-order mark but is not {encoding.upper()} text "
                    f"({where}); save it as UTF-8") from None
    nul = text.find("\0")
    if nul >= 0:
        raise error(f"{label} holds a NUL character (line {text.count(chr(10), 0, nul) + 1}): a binary file, not text")
    return text


def read_text(path: str | os.PathLike, label: str, limit: int, error: type[Exception]) -> str:
    """:func:`read_bytes` then :func:`decode_text`."""
    return decode_text(read_bytes(path, label, limit, error), label, error)


def lone_surrogate(value: Any, key: str = "") -> tuple[str, str] | None:
    """``(key path, character)`` of the first string in ``value`` holding an unpaired UTF-16 surrogate, else None.

    Why: JSON may escape one (``"\\ud800"``) and Python's parser takes it, but it is no character: a
    tokenizer, pyarrow or a UTF-8 writer fails on it later, far from the row that held it.

    Example:
        >>> lone_surrogate({"messages": [{"role": "user", "content": "a\\ud800"}]})
        ('messages[0].content', '\\ud800')
    """
    stack = [(key, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            bad = next((c for c in item if "\ud800" <= c <= "\udfff"), None)
            if bad is not None:
                return where or "(the value)", bad
        elif isinstance(item, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(item.items())))
            stack.extend((f"{where}.{k}" if where else str(k), k) for k in item if isinstance(k, str))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


class _Constant(ValueError):
    def __init__(self, word: str):
        super().__init__(word)
        self.word = word


def _no_constant(word: str) -> Any:
    raise _Constant(word)


class DuplicateKey(ValueError):
    """A JSON object holds ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``' ``object_pairs_hook`` refusing an object that holds a key twice.

    Why: JSON leaves the meaning open and readers disagree (Python keeps the last, other readers the first or
    both): a config whose ``hidden_size`` appears twice was read one way here and another way by the library.
    """
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        raise DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return value


def parse_json(text: str, label: str, error: type[Exception], allow_nan: bool = False) -> Any:
    """``json.loads(text)``; a syntax error names its line and column, a lone surrogate its key, and ``NaN``,
    ``Infinity`` or ``-Infinity`` (which Python's parser takes though JSON has none) is refused unless
    ``allow_nan`` (a file Python's own writer fills with measurements: a skipped step's loss is NaN).

    Example:
        >>> parse_json('{"a": 1, "b": }', "fsdp.json", ValueError)
        Traceback (most recent call last):
        ValueError: fsdp.json is not valid JSON (Expecting value at line 1, column 15)
    """
    try:
        value = json.loads(text, parse_constant=None if allow_nan else _no_constant, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise error(f"{label} holds the key '{exc.key}' twice in one object; JSON does not say which one counts, and "
                    "readers disagree: keep one") from None
    except _Constant as exc:  # NaN / Infinity: Python's extension, no JSON, and no finite setting of any key
        at = text.find(exc.word)  # the parser does not say where; the first such word outside a string is it
        raise error(f"{label} holds {exc.word} (line {text.count(chr(10), 0, at) + 1}): not valid JSON, and no "
                    "finite number") from None
    except json.JSONDecodeError as exc:
        raise error(f"{label} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise error(f"{label} nests too deep to read (JSON nesting beyond Python's recursion limit)") from None
    found = lone_surrogate(value)
    if found is not None:
        raise error(f"{label}: key '{found[0]}' holds a lone surrogate {found[1]!r} (half of a UTF-16 pair, "
                    "no character): not valid Unicode text")
    return value


MAX_CONFIG_BYTES = 16 << 20
"""A JSON config (``config.json``, an FSDP or DeepSpeed config) is a few KiB; more is not a config."""

MAX_RECORD_BYTES = 256 << 20
"""A checkpoint's records: ``trainer_state.json`` grows with every logged step, a manifest with every tensor."""


def read_json(path: str | os.PathLike, label: str, error: type[Exception], limit: int = MAX_CONFIG_BYTES,
              allow_nan: bool = False) -> Any:
    """A JSON file of any value: read, decoded and parsed as the module doc says (:func:`read_json_object`
    for a file that must hold an object)."""
    return parse_json(read_text(path, label, limit, error), label, error, allow_nan)


def read_json_object(path: str | os.PathLike, label: str, error: type[Exception],
                     limit: int = MAX_CONFIG_BYTES, allow_nan: bool = False) -> dict:
    """A JSON file that must hold an object (a config, a checkpoint's record): read, decoded and parsed as the
    module doc says.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ds.json")
        >>> _ = open(path, "w").write("[1]")
        >>> read_json_object(path, "train.deepspeed: file 'ds.json'", ValueError)
        Traceback (most recent call last):
        ValueError: train.deepspeed: file 'ds.json' holds a JSON list, expected an object
    """
    value = read_json(path, label, error, limit, allow_nan)
    if not isinstance(value, dict):
        raise error(f"{label} holds a JSON {type(value).__name__}, expected an object")
    return value


MAX_FOLDER_TEXT_BYTES = 1 << 30
"""A model folder's JSON, template and vocabulary files: a tokenizer.json of a large vocabulary is tens of MiB."""
_TEXT_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


def check_folder(directory: str | os.PathLike, label: str, error: type[Exception],
                 limit: int = MAX_FOLDER_TEXT_BYTES) -> None:
    """Refuse a model or tokenizer folder holding an entry that is neither a regular file nor a directory (a FIFO
    named ``tokenizer.json`` blocked the library that opened it), or a text file over ``limit`` bytes.

    Only the folder's own entries are looked at (by ``stat``: nothing is opened). Its files are read by
    transformers, which cannot be handed a bound; this is the check made before it is called.

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> os.mkfifo(os.path.join(folder, "tokenizer.json"))
        >>> check_folder(folder, "model.tokenizer: 'tok'", ValueError)
        Traceback (most recent call last):
        ValueError: model.tokenizer: 'tok' holds tokenizer.json, which is a FIFO (named pipe), not a regular file
    """
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise error(f"{label} cannot be listed ({exc.strerror or exc})") from None
    for name in names:
        try:
            info = os.stat(os.path.join(directory, name))
        except OSError:
            continue  # a dangling link: nothing reads it, or its reader says so
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            raise error(f"{label} holds {name}, which is {kind_word(info.st_mode)}, not a regular file")
        if stat.S_ISREG(info.st_mode) and name.endswith(_TEXT_SUFFIXES) and info.st_size > limit:
            raise error(f"{label} holds {name}, {info.st_size:,} bytes, more than the {_size(limit)} such a file may "
                        "hold")
    for name in TOKENIZER_SETTINGS_FILES:
        try:
            settings = read_json_object(os.path.join(directory, name), name, ValueError, limit) if name in names else {}
        except ValueError:
            continue  # not a JSON object: the folder's reader names the file, line and column in its own words
        check_tokenizer_settings(settings, f"{label}: {name}", error)


TOKENIZER_SETTINGS_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SWITCHES = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "add_prefix_space", "legacy",
             "split_special_tokens", "do_lower_case")


def _token(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _tokenizer_rule(key: str) -> tuple[Any, str] | None:
    """``(test, words)`` for a tokenizer setting the library compares, indexes or renders, or None."""
    if key == "model_max_length":
        return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 and v != float("inf"),
                "a whole number of positions >= 1")
    if key in ("padding_side", "truncation_side"):
        return (lambda v: v in ("left", "right"), "'left' or 'right'")
    if key == "chat_template":
        return (lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in v)),
                "a template (text) or a list of {name, template} texts")
    if key in _SPECIAL_TOKENS:
        return (lambda v: v is None or _token(v), "a token: text, or a mapping whose content is text")
    if key == "additional_special_tokens":
        return (lambda v: v is None or (isinstance(v, list) and all(_token(t) for t in v)), "a list of tokens")
    if key == "added_tokens_decoder":
        return (lambda v: isinstance(v, dict) and all(k.isdigit() and k.isascii() and isinstance(t, dict) and
                                                      isinstance(t.get("content"), str) for k, t in v.items()),
                "a mapping of token ids to {content: text, ...}")
    if key in _SWITCHES:
        return (lambda v: v is None or isinstance(v, bool), "true or false")
    return None


def check_tokenizer_settings(settings: dict, label: str, error: type[Exception]) -> None:
    """Refuse a ``tokenizer_config.json`` (or ``special_tokens_map.json``) setting of a type the tokenizer library
    compares, indexes or renders, in one line naming the file and the key.

    Why: transformers takes these as they are and fails far from them: ``model_max_length: "x"`` loaded and then
    ended ``generate`` in a ``TypeError: '>' not supported between 'int' and 'str'`` traceback at the first prompt.

    Example:
        >>> check_tokenizer_settings({"model_max_length": "x"}, "tok: tokenizer_config.json", ValueError)
        Traceback (most recent call last):
        ValueError: tok: tokenizer_config.json: 'model_max_length' is 'x'; expected a whole number of positions >= 1
    """
    for key, value in settings.items():
        rule = _tokenizer_rule(key)
        if rule is not None and not rule[0](value):
            text = repr(value)
            raise error(f"{label}: '{key}' is {text if len(text) <= 60 else text[:57] + '...'}; expected {rule[1]}")
