"""The package says what it is: a licence, type information, one version, and every import it
makes declared in the extra that needs it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

import vitattn

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"PIL": "pillow", "yaml": "pyyaml"}


def test_licence_type_marker_and_one_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert (ROOT / "vitattn" / "py.typed").exists()
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("vitattn") == vitattn.__version__


def test_every_third_party_import_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=;\[ ]", r)[0].lower() for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {re.split(r"[<>=;\[ ]", r)[0].lower() for r in extra}
    imported = set()
    for f in (ROOT / "vitattn").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "vitattn"}
    missing = {DISTRIBUTIONS.get(m, m).lower() for m in third_party} - declared
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_import_vitattn_loads_the_models_and_the_training_half_on_use():
    import subprocess

    code = ("import sys, vitattn\n"
            "print(sorted(m for m in sys.modules if m.startswith('vitattn.')))\n"
            "vitattn.training, vitattn.vitdet.ViTDetBackbone\n"
            "from vitattn.tasks.classify.recipes import RECIPES\n"
            "print('vitattn.tasks.classify.recipes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded, on_use = out.stdout.splitlines()
    models = {"attention", "block", "bof", "cnn", "constants", "contract", "features", "helpers", "init", "patch_embed",
              "pool", "pos_embed", "registry", "scores", "timm_compat", "timm_registry", "vit", "weights", "window"}
    assert set(ast.literal_eval(loaded)) == {f"vitattn.{m}" for m in models}  # no data, training, report, vitdet
    assert on_use == "True"


@pytest.mark.parametrize("old", ["detection", "datasets"])
def test_the_names_before_0_2_are_gone_in_0_3(old):
    """0.2's aliases (vitattn.detection, vitattn.datasets) were removed in 0.3 as announced."""
    import importlib

    assert tuple(map(int, vitattn.__version__.split(".")[:2])) >= (0, 3)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"vitattn.{old}")
    with pytest.raises(AttributeError):
        getattr(vitattn, old)


def module_imports() -> dict[str, set[str]]:
    """Each module of vitattn/ and the modules of vitattn/ it imports at its top level."""
    package = ROOT / "vitattn"
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.parse(path.read_text()).body:  # top level only: what importing the module runs
            if isinstance(node, ast.ImportFrom):
                parts = base.split(".")
                module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                for alias in node.names:
                    deps.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in names else module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def test_no_import_circle_in_the_package():
    graph, state = module_imports(), {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import circle: " + " -> ".join(path[path.index(node):] + [node])
        state[node] = "open"
        for dep in sorted(graph[node]):
            visit(dep, path + [node])
        state[node] = "done"

    assert "vitattn.training.loop" in graph and "vitattn.training.errors" in graph["vitattn.training.loop"]
    for node in sorted(graph):
        visit(node, [])
    assert not {d for d in graph["vitattn.training.errors"] if d.startswith("vitattn")}  # imports nothing of ours


def test_no_script_is_imported_as_a_library():
    """The scripts are imported by their own tests only; benchmarks, results, examples and the
    package use the package (or run a script as a program)."""
    users = [p for folder in ("vitattn", "benchmarks", "results", "examples") for p in (ROOT / folder).rglob("*.py")
             if re.search(r"^\s*(import|from) (train_cifar|train_detection)\b", p.read_text(), re.M)]
    assert not users, users
    with pytest.raises(AttributeError, match="has no attribute 'trian'"):
        vitattn.trian  # noqa: B018


def all_imports(path: Path, name: str) -> set[str]:
    """Every module of ours a file imports, at its top or inside a function."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = base.split(".")
            module = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            out |= {module, *(f"{module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("vitattn")}


def test_imports_run_one_way_tasks_then_machinery_then_models():
    """The models import neither training nor tasks; the run machinery imports no task; a task
    imports no other task (they share vitattn.tasks.images); nothing imports a script."""
    package = ROOT / "vitattn"
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = all_imports(path, name)
        layer = name.split(".")[1] if name.count(".") >= 1 else ""
        if layer not in ("training", "tasks"):
            assert not {d for d in deps if d.startswith(("vitattn.training", "vitattn.tasks"))}, name
        if layer == "training":
            assert not {d for d in deps if d.startswith("vitattn.tasks")}, name
        if layer == "tasks" and name.count(".") >= 3:
            task = name.split(".")[2]
            others = {d for d in deps if d.startswith("vitattn.tasks.") and d.split(".")[2] not in (task, "images")}
            assert not others, (name, others)


def test_the_training_half_reads_in_modules_under_400_lines_with_one_build_run():
    modules = [*(ROOT / "vitattn" / "training").rglob("*.py"), *(ROOT / "vitattn" / "tasks").rglob("*.py")]
    long = {p.relative_to(ROOT).as_posix(): n for p in modules if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    builders = [p.relative_to(ROOT).as_posix() for p in (ROOT / "vitattn").rglob("*.py")
                if re.search(r"^def build_run\(", p.read_text(), re.M)]
    assert builders == ["vitattn/training/run.py"]
