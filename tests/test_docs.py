"""The docs' Python snippets run: each page's ```python blocks execute in order in one namespace."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["concepts.md", "api.md", "detection.md"]


def snippets(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES)
def test_doc_snippets_run(page):
    blocks = snippets(page)
    assert blocks, f"{page} has no python snippets"
    namespace: dict = {}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{page}[snippet {i}]", "exec"), namespace)
        except Exception as e:  # re-raise naming the snippet
            raise AssertionError(f"{page} snippet {i} failed: {e!r}\n{code}") from e
