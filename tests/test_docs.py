"""The docs' Python snippets run: each page's ```python blocks execute in order in one namespace."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["docs/concepts.md", "docs/api.md", "docs/detection.md"]


def snippets(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), flags=re.S | re.M)


def run_page(page: str) -> dict:
    blocks = snippets(page)
    assert blocks, f"{page} has no python snippets"
    namespace: dict = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page}[snippet {i}]", "exec"), namespace)
        except Exception as e:  # re-raise naming the snippet
            raise AssertionError(f"{page} snippet {i} failed: {e!r}\n{code}") from e
    return namespace


@pytest.mark.parametrize("page", PAGES)
def test_doc_snippets_run(page):
    run_page(page)


def test_readme_snippet_runs_and_gives_the_shapes_it_states():
    ns = run_page("README.md")
    assert ns["logits"].shape == (2, 10)
    assert len(ns["maps"]) == 12 and all(m.shape == (2, 3, 197, 197) for m in ns["maps"])
    assert len(ns["feats"]) == 4 and all(f.shape == (2, 192, 14, 14) for f in ns["feats"])
