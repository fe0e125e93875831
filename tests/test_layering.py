"""The import rules, read from the source with ``ast`` (imports inside functions count: a lazy import is still a
dependency). The kernel package's own rule is ``tests/pallas_kernels/test_package.py``.

A *room* is a subpackage or top-level module of ``fathom_jax`` (``decode``, ``checks``, ...; the package's own
``__init__`` is the room ``fathom_jax``). Each checker below takes source text, so that a synthetic violation shows it
reporting (``test_the_checkers_report_violations``): none of them can pass by finding nothing to check.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fathom_jax"

# The floors, lowest first: a room imports only rooms on floors below its own (and itself). This is the layering the
# import graph had when the rule was written (each room one floor above the highest room it imports). A new room gets
# a floor here; an import that needs a room to move up is a design change: move it in this table, on purpose.
FLOORS: tuple[frozenset[str], ...] = tuple(map(frozenset, (
    {"fathom_jax", "checks", "distributed", "format", "hlo"},  # import no room
    {"models", "planner", "select", "store"},
    {"allocation", "calibrate", "rows"},
    {"index"},
    {"methods"},
    {"placement", "scan"},
    {"decode"},
    {"eval", "serve"},
    {"cli"},
)))
MODELS_MAY_IMPORT = {"models", "checks"}  # the decoders know nothing of the sparse code
# scripts/ measure the library through a small surface: today the package's own names (``fathom_jax``), ``decode``,
# ``models``, ``eval``, ``serve`` and the kernels (``pallas_kernels``); a name of another room is reached through one
# of them, or the script is a reason to widen this on purpose
SCRIPT_ROOMS = 6


# ---------------------------------------------------------------------------------------------
# Reading imports


def module_name(path: pathlib.Path, root: pathlib.Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import in ``source`` (the text of ``module``): ``import a.b`` gives
    ``("a.b", None)``, ``from a import b`` gives ``("a", "b")``; relative imports are resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found += [(node.lineno, base, a.name) for a in node.names]
    return found


def room(module: str) -> str | None:
    """The room of a ``fathom_jax`` module (None: not the library's)."""
    parts = module.split(".")
    if parts[0] != "fathom_jax":
        return None
    return parts[1] if len(parts) > 1 else "fathom_jax"


def rooms_imported(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, room)`` of each import of a library module (``from fathom_jax import decode`` is room ``decode``;
    ``from fathom_jax import __version__`` the package's own)."""
    out = []
    for line, mod, name in imports(source, module, is_package):
        if mod == "fathom_jax" and name and ((PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").exists()):
            mod = f"fathom_jax.{name}"
        if room(mod):
            out.append((line, room(mod)))
    return out


def library_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


# ---------------------------------------------------------------------------------------------
# The checkers: each returns one message per violation


def floor_violations(sources: dict[str, tuple[str, bool]], floors=FLOORS) -> list[str]:
    """A module that imports a room on its own floor or above, e.g. ``fathom_jax/store/read.py`` holding
    ``from fathom_jax.decode import StepConfig`` gives
    ``fathom_jax.store.read:3 imports decode (floor 6) from store (floor 1)``."""
    floor = {r: i for i, rooms in enumerate(floors) for r in rooms}
    out = []
    for module, (source, is_package) in sources.items():
        own = room(module)
        for line, other in rooms_imported(source, module, is_package):
            if other != own and floor.get(other, len(floors)) >= floor.get(own, -1):
                out.append(f"{module}:{line} imports {other} (floor {floor.get(other, '?')}) from {own} "
                           f"(floor {floor.get(own, '?')})")
    return out


def models_violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """A ``fathom_jax.models`` module that imports a library room but ``checks``, e.g. ``fathom_jax/models/hub.py``
    holding ``from fathom_jax import decode`` gives ``fathom_jax.models.hub:3 imports fathom_jax.decode``."""
    out = []
    for module, (source, is_package) in sources.items():
        if room(module) == "models":
            out += [f"{module}:{line} imports fathom_jax.{other}"
                    for line, other in rooms_imported(source, module, is_package) if other not in MODELS_MAY_IMPORT]
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_violations(source: str, where: str) -> list[str]:
    """``_private`` names a script or the CLI takes from the library: imported (``from fathom_jax.cli.args import
    _Parser`` gives ``app.py:1 imports fathom_jax.cli.args._Parser``), or read off an imported library module
    (``decode.programs._attention_fn`` gives ``x.py:5 reads decode.programs._attention_fn``)."""
    tree = ast.parse(source)
    out, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and room(node.module or ""):
            for a in node.names:
                if any(_private(p) for p in node.module.split(".")) or _private(a.name):
                    out.append(f"{where}:{node.lineno} imports {node.module}.{a.name}")
                bound.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if room(a.name):
                    if any(_private(p) for p in a.name.split(".")):
                        out.append(f"{where}:{node.lineno} imports {a.name}")
                    bound.add(a.asname or "fathom_jax")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                out.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
    return out


def rooms_of(sources: dict[str, str]) -> set[str]:
    """The library rooms a set of modules imports, the kernel package counted as one (``pallas_kernels``): scripts
    importing ``from fathom_jax import decode, planner`` and ``from pallas_kernels import topk`` use
    ``{"decode", "planner", "pallas_kernels"}``."""
    out = set()
    for module, source in sources.items():
        out |= {r for _, r in rooms_imported(source, module)}
        out |= {"pallas_kernels" for _, mod, _ in imports(source, module) if mod.split(".")[0] == "pallas_kernels"}
    return out


def too_many_rooms(sources: dict[str, str], limit: int = SCRIPT_ROOMS) -> list[str]:
    """One message when ``sources`` import more than ``limit`` rooms, e.g. seven modules each importing another room
    give ``imports 7 rooms (at most 6): checks, decode, eval, fathom_jax, models, pallas_kernels, serve``."""
    rooms = rooms_of(sources)
    return [f"imports {len(rooms)} rooms (at most {limit}): {', '.join(sorted(rooms))}"] if len(rooms) > limit else []


def is_test_module(module: str) -> bool:
    return module.split(".")[0] == "tests" and module.rpartition(".")[2].startswith("test_")


def cross_test_imports(sources: dict[str, str]) -> list[str]:
    """A file under tests/ that imports a test module (``tests/**/test_*.py``); what tests share lives in
    ``tests/support.py`` and the conftest files. ``from tests.models.test_gemma3 import CFG`` in
    ``tests/serve/test_pool.py`` gives ``tests.serve.test_pool:1 imports the test module tests.models.test_gemma3``."""
    out = []
    for module, source in sources.items():
        for line, mod, name in imports(source, module):
            target = mod if is_test_module(mod) else f"{mod}.{name}" if name and is_test_module(f"{mod}.{name}") else None
            if target and target != module:
                out.append(f"{module}:{line} imports the test module {target}")
    return out


# ---------------------------------------------------------------------------------------------
# The rules


def test_every_room_has_one_floor():
    rooms = {p.stem if p.suffix else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    listed = [r for rooms_ in FLOORS for r in rooms_]
    assert len(listed) == len(set(listed)), "a room is on two floors"
    assert set(listed) - {"fathom_jax"} == rooms, (f"rooms without a floor: {sorted(rooms - set(listed))}; floors "
                                                   f"naming no room: {sorted(set(listed) - rooms - {'fathom_jax'})}")


def test_no_module_imports_a_higher_floor():
    assert not floor_violations(library_sources())


def test_models_import_only_checks():
    assert not models_violations(library_sources())


def test_scripts_and_the_cli_use_public_names():
    paths = sorted((REPO / "scripts").rglob("*.py")) + sorted((PACKAGE / "cli").rglob("*.py"))
    assert not [v for p in paths for v in private_violations(p.read_text(), str(p.relative_to(REPO)))]


def test_scripts_import_few_rooms():
    sources = {module_name(p): p.read_text() for p in sorted((REPO / "scripts").rglob("*.py"))}
    assert len(rooms_of(sources)) > 1  # the count sees the scripts' imports
    assert not too_many_rooms(sources)


def test_no_test_imports_another_test_module():
    sources = {module_name(p): p.read_text() for p in sorted((REPO / "tests").rglob("*.py"))}
    assert not cross_test_imports(sources)


def test_the_checkers_report_violations():
    sources = {
        "fathom_jax.store.read": ("import numpy\n\nfrom fathom_jax.decode import StepConfig\n", False),
        "fathom_jax.models.hub": ("import os\n\nfrom fathom_jax import decode\n", False),
        "fathom_jax.models.layers": ("from . import cache\nfrom .. import checks\n", False),  # allowed
        "fathom_jax.select": ("def f():\n    from .scan import scan_scores\n", False),  # relative and lazy: still counted
    }
    assert floor_violations(sources) == [
        "fathom_jax.store.read:3 imports decode (floor 6) from store (floor 1)",
        "fathom_jax.models.hub:3 imports decode (floor 6) from models (floor 1)",
        "fathom_jax.select:2 imports scan (floor 5) from select (floor 1)",
    ]
    assert floor_violations({"fathom_jax.new": ("", False)}, FLOORS) == []
    assert floor_violations({"fathom_jax.new": ("from fathom_jax import checks\n", False)}) == [
        "fathom_jax.new:1 imports checks (floor 0) from new (floor ?)"]  # a room without a floor
    assert models_violations(sources) == ["fathom_jax.models.hub:3 imports fathom_jax.decode"]
    assert private_violations("from fathom_jax.cli.args import _Parser, Parser\n", "app.py") == [
        "app.py:1 imports fathom_jax.cli.args._Parser"]
    assert private_violations("from fathom_jax import decode\nimport fathom_jax.models._x\n\n\n"
                              "p = decode.programs._attention_fn\nq = decode.__name__\n", "x.py") == [
        "x.py:2 imports fathom_jax.models._x", "x.py:5 reads decode.programs._attention_fn"]
    scripts = {f"scripts.s{i}": f"from fathom_jax import {r}\n" for i, r in enumerate(
        ("decode", "models", "eval", "serve", "checks", "__version__"))}
    assert rooms_of(scripts) == {"decode", "models", "eval", "serve", "checks", "fathom_jax"}
    assert too_many_rooms(scripts) == []
    scripts["scripts.k"] = "def f():\n    from pallas_kernels.topk import TopkConfig\n"  # lazy: still counted
    assert too_many_rooms(scripts) == [
        "imports 7 rooms (at most 6): checks, decode, eval, fathom_jax, models, pallas_kernels, serve"]
    assert cross_test_imports({
        "tests.serve.test_pool": "from tests.models.test_gemma3 import CFG\n",
        "tests.cli.test_x": "from tests.cli import test_app\nfrom tests.support import SMOL\nfrom tests.serve import conftest\n",
    }) == ["tests.serve.test_pool:1 imports the test module tests.models.test_gemma3",
           "tests.cli.test_x:1 imports the test module tests.cli.test_app"]
