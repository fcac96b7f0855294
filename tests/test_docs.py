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


def user_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
            *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "journal.md")]


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
