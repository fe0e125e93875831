"""The kernel package's imports: it stands alone (nothing from the library), and no kernel imports another (what they
share lives in the shared modules)."""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "pallas_kernels"
SHARED = {"backend", "plane_layout", "operands", "gather", "topk_radix", "plane_scan_bodies", "plane_scan_common"}
BASE = {"backend", "plane_layout", "operands"}  # what the other shared modules build on
BUILDS_ON = {"plane_scan_common": {"plane_scan_bodies"}}  # a shared module over another one beside the base


def _imported(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_kernels_import_only_the_shared_modules():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    for path in PACKAGE.glob("*.py"):
        ours = {n.split(".")[1] for n in _imported(path) if n.startswith("pallas_kernels.")} & modules
        if path.stem in SHARED:
            allowed = BASE - {path.stem} | BUILDS_ON.get(path.stem, set())
        else:
            allowed = SHARED - {path.stem}
        assert ours <= allowed, f"{path.name} imports {sorted(ours - allowed)}"


def test_the_package_imports_nothing_from_the_library():
    code = ("import sys, pkgutil, importlib, pallas_kernels\n"
            "for m in pkgutil.iter_modules(pallas_kernels.__path__): importlib.import_module('pallas_kernels.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fathom_jax'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "[]"
