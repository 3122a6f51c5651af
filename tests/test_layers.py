"""flowlib's imports go one way: each module imports only from its own layer or the layers below it, with no
cycle, counting imports inside functions too; benchmarks and notebooks use flowlib's public names only.
docs/architecture.md draws these layers."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOWLIB = REPO / "flowlib"

# bottom to top; a module may import from its own layer and the ones before it
LAYERS = {
    "core": {"grad_signal", "config", "runs", "progress", "guards", "metrics", "schedules", "nets", "flows", "unet", "flow_sde",
             "toy2d", "tracking", "sysdeps"},
    "world": {"tasks", "fast_envs", "vector", "metaworld_envs", "visual", "envs", "data", "visual_demos", "smdp"},
    "policy": {"encoders", "chunk_policy", "policy_eval", "bc", "critic", "awsc"},
    "rl core": {"ppo", "buffers", "loop", "learners", "asymmetric"},
    "methods": {"reinflow_agent", "reinflow", "steering", "latent", "latent_sac", "residual", "residual_step", "residual_td3",
                "gaussian", "rfc", "fql"},
    "registry": {"stage3"},
    "tools": {"bench", "export", "evaluate", "pirl", "seeds", "sweep", "run", "results", "__init__"},
}
RANK = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
NAMES = list(LAYERS)


def flowlib_imports(path: Path) -> set[str]:
    """The flowlib modules ``path`` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import y
                out.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x, y
                out |= {a.name for a in node.names}
            elif node.module and node.module.startswith("flowlib"):
                parts = node.module.split(".")
                out |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("flowlib.")}
    return out


def graph() -> dict[str, set[str]]:
    modules = {p.stem for p in FLOWLIB.glob("*.py")}
    return {p.stem: flowlib_imports(p) & modules for p in FLOWLIB.glob("*.py")}


def test_every_flowlib_module_has_a_layer():
    missing = sorted(set(graph()) - set(RANK))
    assert not missing, f"place {missing} in a layer of tests/test_layers.py (and docs/architecture.md)"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{m} ({NAMES[RANK[m]]}) imports {d} ({NAMES[RANK[d]]})"
              for m, deps in graph().items() for d in sorted(deps) if m in RANK and d in RANK and RANK[d] > RANK[m]]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_flowlib_has_no_import_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(g[m] - {m}):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [m, d]))
            elif d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_layering_test_sees_an_upward_import(tmp_path):
    """The walk above finds imports inside functions and both relative forms (so the tests above can fail)."""
    src = tmp_path / "m.py"
    src.write_text("from . import bc\ndef f():\n    from .stage3 import train\n    from flowlib.loop import x\n")
    assert flowlib_imports(src) == {"bc", "stage3", "loop"}


@pytest.mark.parametrize("folder", ["benchmarks", "notebooks"])
def test_benchmarks_and_notebooks_use_flowlib_public_names_only(folder):
    private = []
    for path in sorted((REPO / folder).glob("*.py")):
        text = path.read_text()
        modules = set(re.findall(r"from flowlib import ([\w, ]+)", text))
        names = {n.strip() for group in modules for n in group.split(",")}
        private += [f"{path.name}: {m}" for m in re.findall(r"from flowlib\.\w+ import \(?([^)\n]*_\w*)", text)
                    if any(n.strip().startswith("_") for n in m.split(","))]
        private += [f"{path.name}: {n}.{a}" for n in names for a in re.findall(rf"\b{n}\.(_\w+)", text)]
    assert not private, "private flowlib names used outside flowlib:\n" + "\n".join(private)


def test_the_package_index_lists_every_module_under_its_layer():
    """flowlib/__init__.py's module index is where a newcomer starts: every module is in it, under the layer
    LAYERS gives it."""
    doc = (FLOWLIB / "__init__.py").read_text().split('"""')[1]
    listed, layer = {}, None
    for line in doc.splitlines():
        if re.match(r"^[a-z][a-z ]*(:|$)", line):
            layer = line.split(":")[0].strip()
        elif m := re.match(r"^    (\w+)\s", line):
            listed[m.group(1)] = layer
    modules = {p.stem for p in FLOWLIB.glob("*.py")} - {"__init__"}
    assert not modules - set(listed), f"add these modules to flowlib/__init__.py's index: {sorted(modules - set(listed))}"
    wrong = {m: (listed[m], name) for name, members in LAYERS.items() for m in members if m in listed and listed[m] != name}
    assert not wrong, f"listed under another layer than tests/test_layers.py's LAYERS (index, LAYERS): {wrong}"
