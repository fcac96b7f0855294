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
            "vitattn.train.RECIPES, vitattn.detection.ViTDetBackbone\n"
            "from vitattn import report\n"
            "print('train' in dir(vitattn) or 'vitattn.train' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded, on_use = out.stdout.splitlines()
    models = {"attention", "block", "bof", "cnn", "datasets", "features", "helpers", "init", "patch_embed", "pos_embed",
              "registry", "scores", "timm_compat", "vit", "window"}
    assert set(ast.literal_eval(loaded)) == {f"vitattn.{m}" for m in models}  # no data, training, report, detection
    assert on_use == "True"
    with pytest.raises(AttributeError, match="has no attribute 'trian'"):
        vitattn.trian  # noqa: B018
