"""The numbers of README.md and results/README.md are the result files' (results/tables.py)."""

import importlib.util
from pathlib import Path

import pytest

from ktm.errors import KTMError

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tables", REPO / "results" / "tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def test_every_generated_block_matches_its_result_files(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("page", tables.PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_pages_hold_their_blocks(page):
    names = tables.START.findall(page.read_text())
    assert names and set(names) <= set(tables.BLOCKS)
    if page.name == "README.md" and page.parent == REPO:
        assert names == ["headline", "question_headline"]


def test_an_edited_number_is_out_of_date():
    text = (REPO / "README.md").read_text()
    start = text.index("<!-- generated: headline")
    line = text.index("| **ktm K=4** |", start)
    edited = text[:line] + text[line:].replace("0.", "0.9", 1)
    assert tables.render(edited, REPO / "README.md") == text


@pytest.mark.parametrize("body,match", [
    ("<!-- generated: headline (python results/tables.py) -->\nno end\n", "has no <!-- /generated"),
    ("a\n<!-- generated: nothing (python results/tables.py) -->\n<!-- /generated -->\n",
     "page.md:2: unknown generated block 'nothing'"),
    ("<!-- generated: bench (python results/tables.py) -->\n"
     "<!-- generated: demo (python results/tables.py) -->\n<!-- /generated -->\n",
     "page.md:1: block 'bench' has no"),
])
def test_a_malformed_block_is_refused_naming_the_line(body, match):
    with pytest.raises(KTMError, match=match):
        tables.render(body, Path("page.md"))
