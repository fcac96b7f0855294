"""The docs' Python snippets run: each page's ```python blocks execute in order in one namespace."""

import ast
import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def user_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "results" / "README.md",
            *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in ("journal.md", "changelog.md"))]


PAGES = [str(p.relative_to(ROOT)) for p in user_pages() if "```python" in p.read_text() and p.name != "README.md"
         or p == ROOT / "README.md"]


def snippets(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M)


def shown_output(lines: list[str], node: ast.stmt) -> str | None:
    """What a snippet shows a statement prints: the comment lines right after it, else the
    comment at the end of its last line; None when it shows nothing."""
    after = []
    for line in lines[node.end_lineno:]:
        if not line.startswith("#"):
            break
        after.append(line[1:].strip())
    if after:
        return "\n".join(after)
    code = lines[node.end_lineno - 1]
    return code.split("  # ", 1)[1].strip() if "  # " in code else None


def run_page(page: str) -> dict:
    """Run a page's snippets in order in one namespace, statement by statement, comparing what
    each statement prints with the output the page shows for it (a statement that prints must
    show its output; one whose comment is no output prints nothing)."""
    blocks = snippets(page)
    assert blocks, f"{page} has no python snippets"
    namespace: dict = {}
    torch.manual_seed(0)
    for i, code in enumerate(blocks):
        lines = code.splitlines()
        for node in ast.parse(code).body:
            source = "\n".join(lines[node.lineno - 1:node.end_lineno])
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    exec(compile(ast.Module([node], []), f"{page}[snippet {i}]", "exec"), namespace)
            except Exception as e:  # re-raise naming the snippet
                raise AssertionError(f"{page} snippet {i} failed: {e!r}\n{source}") from e
            printed = out.getvalue().strip()
            if printed:
                shown = shown_output(lines, node)
                assert shown is not None, f"{page} snippet {i} prints {printed!r} but does not show it:\n{source}"
                assert printed == shown, f"{page} snippet {i} prints\n{printed}\nbut shows\n{shown}\n{source}"
    return namespace


@pytest.mark.parametrize("page", [p for p in PAGES if p != "README.md"])
def test_doc_snippets_run_and_print_what_they_show(page):
    run_page(page)


def test_every_page_with_python_runs_here():
    assert {"docs/api.md", "docs/concepts.md", "docs/context.md", "docs/detection.md", "README.md"} <= set(PAGES)


def test_readme_snippet_runs_and_gives_the_shapes_it_states():
    ns = run_page("README.md")
    assert ns["logits"].shape == (2, 10)
    assert len(ns["maps"]) == 12 and all(m.shape == (2, 3, 197, 197) for m in ns["maps"])
    assert len(ns["feats"]) == 4 and all(f.shape == (2, 192, 14, 14) for f in ns["feats"])


def test_no_page_keeps_a_placeholder_where_text_belongs():
    # a draft's stand-in (a line that is one NAME_TEXT / NAME_TABLE word) must not reach a reader
    for page in user_pages():
        left = re.findall(r"^[A-Z][A-Z0-9]*_[A-Z0-9_]+$", page.read_text(), flags=re.M)
        assert not left, f"{page.relative_to(ROOT)} still has {left}"


def test_user_docs_stay_lean():
    # docs/*.md without the journal: at most 12,000 words, no page over 350 lines (what a newcomer reads)
    pages = [p for p in user_pages() if p.parent.name == "docs"]
    assert sum(len(p.read_text().split()) for p in pages) <= 12_000
    assert [p.name for p in pages if len(p.read_text().splitlines()) > 350] == []
    assert len(list((ROOT / "docs" / "results").iterdir())) <= 40


SCRIPTS = {"train_cifar.py": ("train_cifar", "command_line"),
           "examples/train_detection.py": ("examples.train_detection", "command_line"),
           "results.build": ("results.build", "main"),
           **{f"benchmarks.{m}": (f"benchmarks.{m}", "main") for m in ("bench_vit", "bench_detection", "gpu_check",
                                                                        "precision_step", "seeds_step",
                                                                        "time_to_accuracy")}}
OTHER_TOOLS = {"--nproc_per_node", "--logdir", "--extra-index-url", "--index-url"}  # torchrun, tensorboard, pip


def flags_of(script: str) -> set[str]:
    """The options a script's --help lists, read in process."""
    import importlib
    import sys
    from unittest import mock

    module, entry = SCRIPTS[script]
    mod = importlib.import_module(module)
    out = io.StringIO()
    with mock.patch.object(sys, "argv", [script, "--help"]), contextlib.redirect_stdout(out), \
            pytest.raises(SystemExit):
        fn = getattr(mod, entry)
        fn(["--help"]) if "argv" in fn.__code__.co_varnames else fn()
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", out.getvalue()))


def test_every_option_a_page_names_exists_and_every_command_parses():
    """Each ``--option`` a user page names is an option of one of the project's scripts (or of
    torchrun, tensorboard, pip), and each command a page shows uses only its script's options."""
    flags = {script: flags_of(script) for script in SCRIPTS}
    known = set().union(*flags.values()) | OTHER_TOOLS
    for page in user_pages():
        text = page.read_text()
        named = set(re.findall(r"(?<![\w/-])--[a-z][\w-]*", text)) - {"--no-"}
        unknown = sorted(f for f in named if f not in known and f.replace("--no-", "--", 1) not in known)
        assert not unknown, f"{page.relative_to(ROOT)} names options no script has: {unknown}"
        for line in re.findall(r"python (?:-m )?(\S+)([^\n`|]*)", text):
            script, rest = line
            if script in SCRIPTS:
                used = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", rest.split("#")[0]))
                bad = sorted(f for f in used if f not in flags[script] and f.replace("--no-", "--", 1)
                             not in flags[script])
                assert not bad, f"{page.relative_to(ROOT)}: python {script}{rest} uses {bad}"


def test_what_readme_and_the_presets_say_of_sizes_and_extras_is_true():
    """README's extras sentence names every package of pyproject's ``train`` extra, and a preset's
    "~N M params" is its parameter count rounded as written."""
    import vitattn

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    sentence = re.search(r"`\.\[train\]` adds ([^;]*);", (ROOT / "README.md").read_text()).group(1).lower()
    for requirement in extras["train"]:
        name = re.match(r"[\w-]+", requirement).group(0).lower()
        assert name in sentence, f"README's .[train] list lacks {name}"
    for name, (_, _, purpose) in vitattn.registry.PRESETS.items():
        said = re.search(r"~(\d+(?:\.(\d+))?)M params", purpose)
        if said:
            digits = len(said.group(2) or "")
            count = sum(p.numel() for p in vitattn.create_model(name).parameters()) / 1e6
            assert round(count, digits) == float(said.group(1)), (name, count, said.group(0))


def test_every_image_in_docs_is_shown_somewhere():
    pages = "".join(p.read_text() for p in [*user_pages(), ROOT / "docs" / "journal.md"])
    unused = sorted(p.name for p in (ROOT / "docs" / "img").iterdir() if p.name not in pages)
    assert not unused, f"docs/img holds images no page shows: {unused}"


def test_every_readme_command_on_a_run_folder_runs_as_written(tmp_path, folder):
    """The commands README and benchmarks/README show on run folders (``runs/...``) run as
    written on folders the main job made (a tiny run of both models), in a fresh directory."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys

    from conftest import tiny

    import train_cifar as T

    made = Path(T.main(tiny(tmp_path / "made", folder, model="both", epochs=1, vit_preset="vit_quick"))["out"])
    commands = [c for page in (ROOT / "README.md", ROOT / "benchmarks" / "README.md")
                for c in re.findall(r"`(python [^`]*runs/[^`]*)`|^(python .*runs/.*)$", page.read_text(), re.M)]
    commands = [a or b for a, b in commands]
    assert any("time_to_accuracy" in c for c in commands)  # the tool the issue found refusing default runs
    work = tmp_path / "work"
    for command in commands:
        argv = shlex.split(command.split("  #")[0])
        for arg in argv:
            if arg.startswith("runs/") and not (work / arg).exists():
                shutil.copytree(made, work / arg)
        argv = [sys.executable, *(str(ROOT / a) if a.endswith(".py") else a for a in argv[1:])]
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
    assert (work / "docs" / "img" / "time_to_accuracy_curves.png").is_file()
