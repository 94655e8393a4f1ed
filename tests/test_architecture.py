"""The package's import graph: layers only look down, and no two files import each other in a circle.

Every ``import`` of a neutrain module is parsed, at module level and inside
functions alike (a lazy import is still a dependency), plus
``importlib.import_module("neutrain...")`` with a literal name. The layer order
is the one drawn in ``docs/architecture.md``:

    errors, files, compat ← config, data, storage ← kernels ← compress ← optim ← nn ← decode
        ← attention, eval, export, distributed ← memory ← speculative ← trainer ← distill ← cli

A module may import its own package and any package of a strictly lower layer.
``config`` and ``data`` stand apart: they may import only ``errors``, ``files`` and ``compat``.

Imports sit at module top. In the packages of :data:`LAZY_MARKED`, an import of a
neutrain module inside a function must say why on its line (or in the comment right above) with
``# lazy: <reason>`` (Triton on a CPU path, the light ``import neutrain``, a real cycle).
The other packages opt in by joining that list.
"""

from __future__ import annotations

import ast
import re
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "neutrain"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "files", "starting", "compat"),
    ("config", "data", "storage"),
    ("kernels",),
    ("compress",),
    ("optim",),
    ("nn",),
    ("decode",),
    ("attention", "eval", "export", "distributed"),
    ("memory",),
    ("speculative",),
    ("trainer",),
    ("distill",),  # the DistillationTrainer is a NeuTrainer
    ("cli",),
    ("", "__main__"),  # the package root (``neutrain/__init__.py``, ``__main__.py``): the public entry points
]
RANK = {pkg: rank for rank, group in enumerate(LAYERS) for pkg in group}
APART = {"config", "data", "storage"}  # may import only the bottom layer


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The neutrain module a dotted name lives in (``neutrain.nn.CompressedLinear`` -> ``neutrain.nn``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every neutrain module ``module`` imports, wherever in the file the import sits."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from neutrain.nn import lora`` imports the submodule ``neutrain.nn.lora``
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in MODULES else stem for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        for name in names:
            if name == "neutrain" or name.startswith("neutrain."):
                target = _resolve(name)
                if target and target != module:
                    found.add(target)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_package_has_a_layer():
    unplaced = sorted({package_of(m) for m in MODULES} - set(RANK))
    assert not unplaced, f"packages with no place in LAYERS: {unplaced}"


def test_imports_only_look_down():
    upward = []
    for module, targets in sorted(GRAPH.items()):
        pkg = package_of(module)
        for target in sorted(targets):
            tpkg = package_of(target)
            if tpkg == pkg:
                continue
            if pkg in APART:
                ok = RANK[tpkg] == 0
            else:
                ok = RANK[tpkg] < RANK[pkg]
            if not ok:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each a circle of imports."""
    graph = GRAPH if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_edge(a: str, b: str) -> bool:
    # A package's ``__init__`` re-exports its own modules; that is not a circle of ideas.
    return MODULES[a].name == "__init__.py" and b.startswith(a + ".")


def test_no_import_cycles_between_files():
    cycles = []
    for component in _cycles():
        members = set(component)
        # drop edges from a package __init__ into its own modules and look again
        inner = {m: {t for t in GRAPH[m] if t in members and not _package_edge(m, t)} for m in component}
        if _has_cycle(inner):
            cycles.append(" <-> ".join(component))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _has_cycle(graph: dict[str, set[str]]) -> bool:
    state: dict[str, int] = {}

    def visit(v: str) -> bool:
        state[v] = 1
        for w in graph[v]:
            if state.get(w) == 1 or (w not in state and visit(w)):
                return True
        state[v] = 2
        return False

    return any(v not in state and visit(v) for v in graph)


@pytest.mark.parametrize("source, expected", [
    ("from neutrain.nn import lora\n", {"neutrain.nn.lora"}),
    ("def f():\n    from neutrain.trainer.trainer import NeuTrainer\n", {"neutrain.trainer.trainer"}),
    ("import importlib\nimportlib.import_module('neutrain.cli.main')\n", {"neutrain.cli.main"}),
])
def test_the_parser_sees_every_kind_of_import(tmp_path, monkeypatch, source, expected):
    # The checks above are only as good as the parser: a lazy import must count.
    fake = ROOT / "kernels" / "_architecture_probe.py"
    monkeypatch.setitem(MODULES, "neutrain.kernels._architecture_probe", tmp_path / "probe.py")
    (tmp_path / "probe.py").write_text(source)
    assert imports_of("neutrain.kernels._architecture_probe") == expected
    assert not fake.exists()


def test_the_architecture_diagram_shows_every_package_in_its_layer():
    # docs/architecture.md's diagram (its first code block) lists the layers top-down, one line per layer.
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    diagram = page.split("```", 2)[1]
    shown: dict[str, int] = {}
    for depth, line in enumerate(diagram.strip().splitlines()):
        for token in line.split():
            name = token.rstrip("/").removesuffix(".py")
            if token.endswith(("/", ".py")) and name in RANK and name:
                shown[name] = depth
    packages = {p for p in RANK if p not in ("", "__main__")}
    assert set(shown) == packages, f"diagram and package differ: {sorted(set(shown) ^ packages)}"
    # a higher layer is drawn above (earlier than) a lower one
    misplaced = [(a, b) for a in shown for b in shown if RANK[a] > RANK[b] and shown[a] > shown[b]
                 and not ({a, b} & APART or RANK[b] == 0)]
    assert not misplaced, f"drawn in the wrong order: {misplaced}"


#: Packages whose function-level neutrain imports must carry a ``# lazy: <reason>`` comment.
LAZY_MARKED = ("kernels", "compress", "attention", "decode", "eval", "memory", "speculative", "distill", "export",
               "data",
               "storage", "config", "cli", "")


def unmarked_lazy_imports(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` holding a neutrain import inside a function with no ``# lazy:`` reason."""
    source = path.read_text()
    lines = source.splitlines()
    found = set()
    for fn in ast.walk(ast.parse(source, str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                internal = node.level > 0 or (node.module or "").split(".")[0] == "neutrain"
            elif isinstance(node, ast.Import):
                internal = any(alias.name.split(".")[0] == "neutrain" for alias in node.names)
            else:
                continue
            here = lines[node.lineno - 1 : node.end_lineno]
            above = []  # the comment block right above the import
            row = node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.append(lines[row])
                row -= 1
            if internal and not any("# lazy:" in line for line in [*above, *here]):
                found.add(node.lineno)
    return sorted(found)


def test_lazy_imports_say_why():
    unmarked = [f"{module.replace('.', '/')}.py:{line}" if MODULES[module].name != "__init__.py"
                else f"{module.replace('.', '/')}/__init__.py:{line}"
                for module in sorted(MODULES) if package_of(module) in LAZY_MARKED
                for line in unmarked_lazy_imports(MODULES[module])]
    assert not unmarked, ("neutrain imports inside functions without a '# lazy: <reason>' comment "
                          "(move them to module top, or say why they must wait):\n" + "\n".join(unmarked))


@pytest.mark.parametrize("source, expected", [
    ("from neutrain.errors import RecipeError\n", []),  # module top: fine
    ("def f():\n    from neutrain.errors import RecipeError\n", [2]),
    ("def f():\n    from .kv import MiniCache\n", [2]),  # relative imports count
    ("def f():\n    import torch\n", []),  # only neutrain's own graph is checked
    ("def f():\n    from neutrain.kernels import codec  # lazy: Triton\n", []),
    ("def f():\n    # lazy: Triton, GPU path only\n    from neutrain.kernels import codec\n", []),
    ("def f():\n    # lazy: a cycle.\n    # More words.\n    from neutrain.kernels import codec\n", []),
    ("def f():\n    # lazy: a cycle.\n    x = 1\n    from neutrain.kernels import codec\n", [4]),
    ("class C:\n    def m(self):\n        def g():\n            import neutrain.nn\n", [4]),
])
def test_the_lazy_check_sees_unmarked_imports(tmp_path, source, expected):
    (tmp_path / "probe.py").write_text(source)
    assert unmarked_lazy_imports(tmp_path / "probe.py") == expected


# --- benchmarks/: scripts import one another, by package name or as bare siblings ------------------

BENCHMARKS = ROOT.parent / "benchmarks"


def _benchmark_modules() -> dict[str, pathlib.Path]:
    """``benchmarks.kv.kv_eval`` -> ``benchmarks/kv/kv_eval.py``, ``benchmarks._common`` -> ``benchmarks/_common.py``."""
    return {".".join(path.relative_to(ROOT.parent).with_suffix("").parts): path
            for path in BENCHMARKS.rglob("*.py") if "__pycache__" not in path.parts}


BENCHMARK_MODULES = _benchmark_modules()


def benchmark_imports_of(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The benchmark modules a file imports, anywhere in it.

    Scripts put the repository root on ``sys.path`` and import by the full name (``benchmarks.kv._kv_real``);
    a bare sibling import (``codec``) counts too.
    """
    found: set[str] = set()
    own = next(name for name, p in modules.items() if p == path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            for candidate in (name, f"benchmarks.{name}", f"{own.rpartition('.')[0]}.{name}"):
                while candidate and candidate not in modules:
                    candidate = candidate.rpartition(".")[0]
                if candidate.startswith("benchmarks."):
                    found.add(candidate)
                    break
    return found - {own}


def test_no_import_cycles_between_benchmark_files():
    graph = {name: benchmark_imports_of(path, BENCHMARK_MODULES) for name, path in BENCHMARK_MODULES.items()}
    cycles = [" <-> ".join(c) for c in _cycles(graph)]
    assert not cycles, "import cycles between benchmark files:\n" + "\n".join(cycles)


def test_the_benchmark_cycle_check_sees_bare_and_package_imports(tmp_path):
    # Two files that import each other, one by the package name and one as a bare sibling, are a circle.
    (tmp_path / "benchmarks").mkdir()
    a, b = tmp_path / "benchmarks" / "a.py", tmp_path / "benchmarks" / "b.py"
    a.write_text("def f():\n    from benchmarks.b import g\n")
    b.write_text("from a import f\n")
    modules = {"benchmarks.a": a, "benchmarks.b": b}
    graph = {name: benchmark_imports_of(path, modules) for name, path in modules.items()}
    assert graph == {"benchmarks.a": {"benchmarks.b"}, "benchmarks.b": {"benchmarks.a"}}
    assert _cycles(graph) == [["benchmarks.a", "benchmarks.b"]]


# --- names say what, not when: no issue numbers --------------------------------------------------
# A reader without the tracker cannot follow "issue 27" or ``gpu_issue30.sh``: a comment says the
# reason itself, a name says what the thing does or measures.

ISSUE_CITATION = re.compile(r"(?<![a-z])issues?[\s_#-]*\d", re.IGNORECASE)

TEXT_SUFFIXES = {".py", ".sh", ".md", ".json", ".txt", ".yaml", ".toml", ".cfg"}


RECORD_SUFFIXES = {".json", ".xml", ".log", ".txt"}


def _is_record(relative: pathlib.PurePath) -> bool:
    """A measurement record (JSON, junit, log) in ``benchmarks/``: kept as the run wrote it.

    Records are never edited by hand (``benchmarks/README.md``, Records); the scripts that write
    them name no issue, so the next run's record names none. Their names are checked like any file's.
    """
    return relative.parts[0] == "benchmarks" and relative.suffix in RECORD_SUFFIXES


def issue_citations(top: pathlib.Path, root: pathlib.Path = ROOT.parent) -> list[str]:
    """``path: text`` for every file under ``top`` whose name, or whose text, cites an issue number."""
    found = []
    for path in sorted(top.rglob("*")):
        relative = path.relative_to(root)
        if "__pycache__" in relative.parts:
            continue
        name = ISSUE_CITATION.search(relative.as_posix())
        if name:
            found.append(f"{relative}: named {name.group(0)!r}")
        if path.is_file() and path.suffix in TEXT_SUFFIXES and not _is_record(relative):
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if ISSUE_CITATION.search(line):
                    found.append(f"{relative}:{number}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("top", ["neutrain", "benchmarks"])
def test_no_file_cites_an_issue_number(top):
    found = issue_citations(ROOT.parent / top)
    assert not found, ("say the reason, or name the thing by what it does, instead of citing an issue:\n"
                       + "\n".join(found))


def test_no_test_is_named_after_an_issue():
    # Test files and test functions say the behaviour they check.
    tests = ROOT.parent / "tests"
    found = [f"{path.relative_to(tests)}" for path in tests.rglob("*.py") if ISSUE_CITATION.search(path.name)]
    for path in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ISSUE_CITATION.search(node.name):
                found.append(f"{path.relative_to(tests)}:{node.lineno}: {node.name}")
    assert not found, "tests named after an issue (name them by the behaviour they check):\n" + "\n".join(found)


@pytest.mark.parametrize("text, cites", [
    ("# why (issue 27): no phase holds a second copy", True),
    ("Issue 30's device calls", True),
    ("bash benchmarks/gpu_issue33.sh", True),
    ("def test_issue_19_records_name_every_target():", True),
    ("(issues 5, 18)", True),
    ("results/archive/issue30_runs/", True),
    ("see #27", False),  # only the word 'issue' with a number is looked for
    ("a tissue 3 mm thick", False),
    ("no issue with 8 GB cards", False),
])
def test_the_citation_pattern(text, cites):
    assert bool(ISSUE_CITATION.search(text)) is cites


def test_the_citation_check_reads_names_and_text_but_not_records(tmp_path):
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "gpu_issue30.sh").write_text("echo ok\n")
    (tmp_path / "benchmarks" / "codec.py").write_text("x = 1  # 1/32 headroom (issue 30 measured why)\n")
    (tmp_path / "benchmarks" / "results" / "codec.json").write_text('{"goal_source": "issue 16"}\n')
    (tmp_path / "benchmarks" / "notes_lr.json").write_text('{"targets_note": "issue 16"}\n')
    (tmp_path / "benchmarks" / "results" / "README.md").write_text("superseded by issue 30's run\n")
    found = issue_citations(tmp_path / "benchmarks", root=tmp_path)
    assert [f.split(":")[0] for f in found] == ["benchmarks/codec.py", "benchmarks/gpu_issue30.sh",
                                                "benchmarks/results/README.md"]


def test_child_processes_of_the_tests_keep_the_inherited_python_path():
    """A test that starts Python with ``PYTHONPATH`` set to the repository alone drops what the environment put
    there (a GPU image's carried packages: pydantic, datasets), and its child fails to import neutrain on that
    machine while passing here. Every child environment goes through ``tests.helpers.child_env``."""
    tests = pathlib.Path(__file__).resolve().parent
    pattern = re.compile(r"""["']PYTHONPATH["']\s*:""")
    offenders = [f"{path.relative_to(tests.parent)}:{n}" for path in sorted(tests.rglob("*.py"))
                 if path.name not in ("helpers.py", "test_architecture.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"set PYTHONPATH through tests.helpers.child_env: {offenders}"


PORT_FLAG = re.compile(r"""master[_-]port["']|main_process_port["']|MASTER_PORT\s*=""")


def _fixed_ports(root: pathlib.Path) -> list[str]:
    """Lines that give a launcher or a process group a port, in files where no port comes from ``free_port()``
    (a literal, a table of ports, a parameter: each was a fixed port)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if path.name == "test_architecture.py" or "free_port()" in text:
            continue
        found += [f"{path.relative_to(root)}:{n}" for n, line in enumerate(text.splitlines(), 1) if PORT_FLAG.search(line)]
    return found


def _fixed_port_literals(root: pathlib.Path) -> list[str]:
    literal = re.compile(r"""(master[_-]port|main_process_port)["']\s*,\s*["']?\d|MASTER_PORT\s*=\s*["']?\d""")
    return [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py")) if path.name != "test_architecture.py"
            for n, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]


def test_no_test_launches_on_a_fixed_port():
    """A launcher's rendezvous store on a fixed port met a process already holding it (another copy of the
    suite, a job on the machine): EADDRINUSE, a failure unrelated to the test. Ports come from
    ``tests.helpers.free_port``."""
    tests = pathlib.Path(__file__).resolve().parent
    assert _fixed_ports(tests) == [] and _fixed_port_literals(tests) == []


def test_the_fixed_port_check_sees_each_launcher_form(tmp_path):
    (tmp_path / "test_a.py").write_text('a = ["--master_port", str(PORTS[mode])]\nb = ["--main_process_port", "2"]\n'
                                        'c = dict(MASTER_PORT=str(port))\nd = ["--master-port", 29503]\n')
    (tmp_path / "test_b.py").write_text('e = ["--master_port", str(free_port())]\nf = ["--master_port", "29500"]\n')
    assert _fixed_ports(tmp_path) == ["test_a.py:1", "test_a.py:2", "test_a.py:3", "test_a.py:4"]
    assert _fixed_port_literals(tmp_path) == ["test_a.py:2", "test_a.py:4", "test_b.py:2"]


def _long_benchmark_files(root: pathlib.Path, limit: int = 600) -> list[str]:
    """Scripts and notes under ``root`` longer than ``limit`` lines (records, ``*.jsonl``, are tables, not files to read)."""
    long = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".sh", ".md") and path.is_file():
            lines = path.read_text(errors="replace").count("\n")
            if lines > limit:
                long.append(f"{path.relative_to(root)} ({lines} lines)")
    return long


def test_no_benchmark_script_or_note_is_over_600_lines():
    # A note read by question, or a script read top to bottom, past 600 lines is two topics: split it.
    benchmarks = ROOT.parent / "benchmarks"
    assert (benchmarks / "README.md").is_file()
    assert _long_benchmark_files(benchmarks) == []


def test_the_length_check_sees_a_long_note(tmp_path):
    (tmp_path / "topic").mkdir()
    (tmp_path / "topic" / "NOTES.md").write_text("line\n" * 601)
    (tmp_path / "topic" / "results.jsonl").write_text("{}\n" * 2000)
    assert _long_benchmark_files(tmp_path) == ["topic/NOTES.md (601 lines)"]
