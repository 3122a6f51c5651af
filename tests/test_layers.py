"""flowlib's folders are its layers, and its imports go one way: a module imports only from its own folder or the
folders below it, with no cycle, counting imports inside functions too; benchmarks and notebooks use flowlib's public
names only. docs/architecture.md draws these layers."""
import ast
import re
from pathlib import Path

import pytest

from flowlib import _moved

REPO = Path(__file__).resolve().parents[1]
FLOWLIB = REPO / "flowlib"

FOLDERS = ["infra", "flows", "envs", "policies", "rl", "methods", "tools"]  # bottom to top
RANK = {"": -1, **{folder: rank for rank, folder in enumerate(FOLDERS)}}  # "": flowlib/__init__.py and _moved.py


def module_name(path: Path, root: Path = REPO) -> str:
    """``flowlib/policies/bc.py`` -> ``flowlib.policies.bc``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(FLOWLIB.rglob("*.py"))}


def folder(module: str) -> str:
    """The layer folder of a module's dotted name ("" for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS) else ""


def flowlib_imports(path: Path, known: set[str], root: Path = REPO) -> set[str]:
    """The flowlib modules ``path`` imports, at any depth of its code (``from flowlib.x import y`` counts ``y``
    when ``flowlib.x.y`` is a module, else ``flowlib.x``; relative imports resolved)."""
    here = module_name(path, root).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p)
            if not source.startswith("flowlib"):
                continue
            for alias in node.names:
                out.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("flowlib")}
    return out


def graph() -> dict[str, set[str]]:
    known = set(modules())
    return {m: flowlib_imports(p, known) & known for m, p in modules().items()}


def test_every_module_lives_in_a_layer_folder():
    stray = [m for m in modules() if folder(m) == "" and m not in ("flowlib", "flowlib._moved")]
    folders = {p.name for p in FLOWLIB.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not stray, f"move {stray} into one of flowlib's layer folders {FOLDERS}"
    assert folders == set(FOLDERS), f"flowlib's folders {sorted(folders)} are not the layers {FOLDERS}: add the new one here"


def test_every_old_flat_path_leads_to_a_module_that_exists():
    """flowlib/_moved.py's LAYOUT keeps the paths of before the folders working: each names a module in its folder."""
    gone = [f"flowlib/{f}/{m}.py" for f, ms in _moved.LAYOUT.items() for m in ms if not (FLOWLIB / f / f"{m}.py").exists()]
    assert list(_moved.LAYOUT) == FOLDERS
    assert not gone, f"flowlib/_moved.py's LAYOUT names modules that are gone: {gone}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{m} ({folder(m) or 'root'}) imports {d} ({folder(d)})"
              for m, deps in graph().items() for d in sorted(deps) if RANK[folder(d)] > RANK[folder(m)]]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_flowlib_has_no_import_cycle():
    g = {m: {d for d in deps if d != m and not m.startswith(d + ".")} for m, deps in graph().items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [m, d]) if d in stack else f"{m} -> {d}")
            elif d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layering_test_sees_every_import_form(tmp_path):
    """The walk above finds imports inside functions, package imports and relative ones (so the tests above can
    fail): a module in rl/ importing from methods/ is upward."""
    src = tmp_path / "flowlib" / "rl" / "m.py"
    src.parent.mkdir(parents=True)
    src.write_text("from flowlib.policies import bc\ndef f():\n    from flowlib.methods.stage3 import train\n"
                   "    from .loop import x\n    import flowlib.infra.config\n")
    known = {"flowlib.policies.bc", "flowlib.methods.stage3", "flowlib.rl.loop", "flowlib.infra.config"}
    assert flowlib_imports(src, known, root=tmp_path) == known
    assert RANK[folder("flowlib.methods.stage3")] > RANK[folder("flowlib.rl.m")]


@pytest.mark.parametrize("where", ["benchmarks", "notebooks"])
def test_benchmarks_and_notebooks_use_flowlib_public_names_only(where):
    private = []
    for path in sorted((REPO / where).glob("*.py")):
        text = path.read_text()
        imported = re.findall(r"from flowlib(?:\.\w+)* import \(?([^)\n#]*)", text)
        names = {n.strip().split(" as ")[-1] for group in imported for n in group.split(",") if n.strip()}
        private += [f"{path.name}: {n}" for n in names if n.startswith("_")]
        private += [f"{path.name}: {n}.{a}" for n in names for a in re.findall(rf"\b{n}\.(_\w+)", text)]
    assert not private, "private flowlib names used outside flowlib:\n" + "\n".join(private)


def test_the_package_index_lists_every_module_under_its_folder():
    """flowlib/__init__.py's index names every module after its folder, and each folder's ``__init__`` gives every
    module a line that says its job: that is where a newcomer starts."""
    index = (FLOWLIB / "__init__.py").read_text().split('"""')[1]
    listed = {}
    for line in re.sub(r"\n {10}", " ", index).splitlines():
        if (m := re.match(r"^(\w+) {2,}(.+)$", line)) and m.group(1) in FOLDERS:
            listed[m.group(1)] = set(re.findall(r"(\w+)(?: \([^)]*\))?(?:,|$)", m.group(2)))
    for f in FOLDERS:
        mods = {p.stem for p in (FLOWLIB / f).glob("*.py")} - {"__init__"}
        assert mods <= listed.get(f, set()), f"add {sorted(mods - listed.get(f, set()))} to {f}'s line of flowlib/__init__.py"
        doc = (FLOWLIB / f / "__init__.py").read_text().split('"""')[1]
        described = set(re.findall(r"^    (\w+)\s", doc, re.M))
        assert mods <= described, f"describe {sorted(mods - described)} in flowlib/{f}/__init__.py's docstring"


# third-party packages that are optional extras (gymnasium and h5py come with the sim / metaworld extras; the fast
# tasks need neither) or slow to import: the only imports a function may hold, each loaded where it is needed, so
# that a fast task runs without the simulators and `python -m flowlib.results check` does not start torch
LAZY = {"mani_skill", "sapien", "metaworld", "gymnasium", "h5py", "papermill", "nbconvert", "jupyter_server_mathjax",
        "ray", "wandb", "ipywidgets", "tqdm", "torch", "diffusers"}


def function_imports(path: Path) -> list[str]:
    """The top-level package of every import inside a function of ``path`` (``.`` for a relative one), in order."""
    out = []

    def visit(node, in_function):
        if in_function and isinstance(node, ast.Import):
            out.extend(a.name.split(".")[0] for a in node.names)
        elif in_function and isinstance(node, ast.ImportFrom):
            out.append("." if node.level else node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return out


def test_imports_inside_functions_are_only_optional_or_heavy_packages():
    """Every other import sits at the top of its module, where a reader (and this test's layering) sees it."""
    bad = [f"{m}: {name}" for m, p in modules().items() for name in function_imports(p) if name not in LAZY]
    assert not bad, "move these imports to the top of their module (or add a slow optional package to LAZY):\n" + "\n".join(bad)


def test_the_function_import_walk_sees_nested_and_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import numpy\ndef f():\n    def g():\n        import h5py\n    from . import x\n    import torch.nn\n")
    assert function_imports(src) == ["h5py", ".", "torch"]
