"""The layers of treecli, by intent (CONTRIBUTING.md), held by its imports, function-local
ones included: cli -> _api (and presentation) -> operations -> formats -> _bytes -> core.
An operation never imports a format or a concrete byte source, and sibling operations
share engines, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "treecli"

ENTRY = {"treecli", "treecli.__main__"}  # the public API's facade and `python -m treecli`: above everything
CORE = {"treecli._keypath", "treecli._index", "treecli._dtypes", "treecli._errors", "treecli._escape",
        "treecli._units", "treecli._leaf", "treecli._devices", "treecli._cluster", "treecli._tree", "treecli._pytree",
        "treecli._gc", "treecli._memory", "treecli._atomic", "treecli._names", "treecli._hostbuffers"}
OPERATIONS = {"treecli._summary", "treecli._slice", "treecli._average", "treecli._merge", "treecli._configmerge",
              "treecli._edit", "treecli._diff", "treecli._layers"}
# shared by operations (and recipes): _tensor_ops' reversible leaves, _transforms' operations by name
ENGINES = {"treecli._combine", "treecli._selection", "treecli._mergeconfig", "treecli._tensor_ops",
           "treecli._transforms"}
METHODS_PACKAGE = "treecli.merge_methods"  # an engine too: the registry of merge methods, one module a family
API = {"treecli._api", "treecli._render"}
RECIPES_PACKAGE = "treecli.recipes"  # with the API: a recipe reads a checkpoint's files and writes a format's metadata
CONCRETE_SOURCES = {"treecli._bytes.local", "treecli._bytes.http", "treecli._bytes.kvstore", "treecli._bytes.upload"}


def layer(module: str) -> int:
    if module in ENTRY:
        return 6
    if module.startswith("treecli.cli"):
        return 5
    if module in API or module == RECIPES_PACKAGE or module.startswith(RECIPES_PACKAGE + "."):
        return 4
    if module in OPERATIONS or module in ENGINES or _in_methods(module):
        return 3
    if module.startswith("treecli.formats"):
        return 2
    if module.startswith("treecli._bytes"):
        return 1
    assert module in CORE, f"{module}: in no layer; add it to tests/test_architecture.py"
    return 0


def _in_methods(module: str) -> bool:
    return module == METHODS_PACKAGE or module.startswith(METHODS_PACKAGE + ".")


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Every treecli module and the treecli modules it imports, wherever in it."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                found.add(base)
                # `from treecli import _tree` imports the module treecli._tree
                found |= {f"{base}.{alias.name}" for alias in node.names
                          if (PACKAGE.parent / f"{base}.{alias.name}".replace(".", "/")).with_suffix(".py").exists()
                          or (PACKAGE.parent / f"{base}.{alias.name}".replace(".", "/")).is_dir()}
        graph[module] = {m for m in found if m == "treecli" or m.startswith("treecli.")} - {module}
    return graph


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    arrows = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target == "treecli":
                continue
            if layer(target) > layer(module):
                arrows.append(f"{module} -> {target}: up from layer {layer(module)} to {layer(target)}")
            elif (module in OPERATIONS | ENGINES or _in_methods(module)) and target in CONCRETE_SOURCES:
                arrows.append(f"{module} -> {target}: an operation reads through a concrete byte source")
            elif module in OPERATIONS and target in OPERATIONS:
                arrows.append(f"{module} -> {target}: sibling operations share engines, not each other")
            elif (module in ENGINES or _in_methods(module)) and target in OPERATIONS:
                arrows.append(f"{module} -> {target}: an engine leans on an operation")
            elif (target.startswith("treecli.formats.") and target != "treecli.formats._base"
                  and not module.startswith("treecli.formats")):
                arrows.append(f"{module} -> {target}: formats are reached through the registry (treecli.formats) "
                              "and their contract (formats._base), never one format's module")
    return arrows


def test_no_import_goes_against_the_layers():
    assert wrong_way(imports()) == []


@pytest.mark.parametrize("module, target", [
    ("treecli._diff", "treecli.formats._filedata"),  # an operation checking a format's leaf class
    ("treecli.formats._outputs", "treecli._render"),  # storage importing presentation
    ("treecli._merge", "treecli._average"),  # siblings leaning on each other
    ("treecli._edit", "treecli._average"),
    ("treecli.cli._common", "treecli.formats.safetensors"),  # the CLI reaching into one format
    ("treecli._diff", "treecli._bytes.local"),  # an operation using a concrete source
])
def test_the_check_catches_each_wrong_way_arrow(module, target):
    assert wrong_way({module: {target}}) != []


@pytest.mark.parametrize("module, target", [
    ("treecli._bytes.stream", "treecli._leaf"), ("treecli._merge", "treecli._combine"),
    ("treecli.cli.edit", "treecli.formats"), ("treecli.formats._verify", "treecli.formats._base"),
    ("treecli.formats.orbax", "treecli.formats.msgpack"), ("treecli._diff", "treecli._bytes.stream"),
])
def test_the_check_lets_downward_arrows_be(module, target):
    assert wrong_way({module: {target}}) == []


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle (module-level or function-local) among the modules of ``graph``."""
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for target in sorted(graph.get(module, ())):
            if target in path:
                circle = path[path.index(target):]
                if not any(set(circle) == set(c) for c in found):
                    found.append(circle)
            elif target not in done and target in graph:
                visit(target, path + [target])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    return found


def _inside_formats(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows between format modules (the registry, ``treecli.formats``, left out: every
    import of a submodule passes through the package)."""
    return {m: {t for t in targets if t.startswith("treecli.formats.")}
            for m, targets in graph.items() if m.startswith("treecli.formats.")}


def test_no_reader_and_writer_import_each_other_inside_formats():
    """A format's reader and writer share a layout module (as gguf-py's constants.py), never
    each other's private names: no circle."""
    assert circles(_inside_formats(imports())) == []


def test_the_check_finds_a_reader_writer_circle():
    assert circles({"treecli.formats.gguf": {"treecli.formats._gguf_write"},
                    "treecli.formats._gguf_write": {"treecli.formats.gguf"}}) != []


def test_no_format_imports_names_from_its_registry():
    """A format module imports submodules of ``treecli.formats``, never the registry's own
    names (what it writes, how to pick a format): those live in ``formats._base``."""
    offenders = []
    for path in sorted((PACKAGE / "formats").glob("*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "treecli.formats":
                names = [a.name for a in node.names if not (PACKAGE / "formats" / f"{a.name}.py").exists()]
                offenders += [f"{path.name}: {name}" for name in names]
    assert offenders == []


# --- merge methods: a registry of modules ------------------------------------------------------------


def _method_names() -> set[str]:
    from treecli.merge_methods import METHODS

    return set(METHODS)


def dispatches_on_method_names(source: str, names: set[str]) -> list[str]:
    """Each comparison of something with a method's name (``method == "slerp"``,
    ``name in ("ram", "ramplus_tl")``, a ``match`` case) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            constants = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else
                                                        o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [])]
            found += [f"line {node.lineno}: {c.value!r}" for c in constants
                      if isinstance(c, ast.Constant) and c.value in names]
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
            found.append(f"line {node.lineno}: case {node.value.value!r}")
    return found


def test_nothing_outside_the_registry_dispatches_on_a_method_name():
    """What a method does is declared in its module (``merge_methods``): no other module
    asks which method it is running."""
    names = _method_names()
    offenders = [f"{path.relative_to(PACKAGE.parent)} {hit}" for path in sorted(PACKAGE.rglob("*.py"))
                 if not _in_methods(_module(path)) for hit in dispatches_on_method_names(path.read_text(), names)]
    assert offenders == []


@pytest.mark.parametrize("source", ['if method == "slerp":\n    pass', 'x = name in ("ram", "ramplus_tl")',
                                    'match m:\n    case "ties":\n        pass'])
def test_the_check_finds_a_dispatch_on_a_method_name(source):
    assert dispatches_on_method_names(source, _method_names()) != []


def test_method_families_are_registered_only_by_the_registry():
    """A family module imports the declarations (``_method``) and private helpers, never
    another family or the registry: adding one is its module and a line in ``FAMILIES``."""
    from treecli import merge_methods

    offenders = []
    for family in merge_methods.FAMILIES:
        for node in ast.walk(ast.parse(Path(family.__file__).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and _in_methods(node.module):
                named = [node.module] if node.module != METHODS_PACKAGE else [
                    f"{METHODS_PACKAGE}.{a.name}" for a in node.names]
                offenders += [f"{family.__name__} -> {n}" for n in named if n.rpartition(".")[2][:1] != "_"]
    assert offenders == []
    assert {m.name for f in merge_methods.FAMILIES for m in f.METHODS} == set(merge_methods.REGISTRY)


def test_every_module_is_under_550_lines():
    """Small modules with one job each: none grows past 550 lines (the merge engine once
    grew to 1,133 around a dispatch; split a module before it gets there)."""
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) >= 550}
    assert long == {}
