"""The docs hold together: every relative link and anchor of README.md and docs/*.md resolves,
every picture lives in docs/img/ and is shown by a page, every figure of the README's status
table is found where it was measured, and no file cites the DESIGN.md that a clone does not have."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for link in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path) if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(REPO)}: {link}")
    assert not broken, broken


def test_pictures_live_in_docs_img_and_each_is_shown():
    assert not list((REPO / "docs").glob("*.png")), "pictures go to docs/img/"
    shown = {Path(link).name for page in PAGES for link in LINK.findall(page.read_text()) if link.endswith(".png")}
    pictures = {p.name for p in (REPO / "docs" / "img").glob("*.png")}
    assert pictures and pictures <= shown, sorted(pictures - shown)


def test_readme_keeps_the_quick_start_commands():
    readme = (REPO / "README.md").read_text()
    for command in ("bash launch/quickstart.sh", "bash tests/run.sh"):
        assert re.search(rf"^{re.escape(command)}\s", readme, re.M), command


FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e-\d+)?)(?:-(\d+(?:\.\d+)?))?(x?)(?![\w.])")


def test_every_figure_of_the_readme_status_table_is_in_status_md_or_the_page_its_row_links():
    """One source per number: the README's status rows quote docs/status.md (or the page a row
    links to), so a figure re-measured there and not here, or typed here alone, fails."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| component | state |"):]
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    assert len(rows) >= 8, rows
    stray = []
    for row in rows:
        summary = row.strip("|").split("|")[2]
        pages = [REPO / "docs" / "status.md", *(REPO / link for link in LINK.findall(summary) if ".md" in link)]
        sources = "".join(p.read_text() for p in pages if p.suffix == ".md")
        for low, high, unit in FIGURE.findall(LINK.sub("]", summary)):
            for figure in filter(None, (low, high)):
                if not re.search(rf"(?<![\w.]){re.escape(figure + unit)}(?![\d])", sources):
                    stray.append(f"{row.split('|')[1].strip()}: {figure}{unit}")
    assert not stray, stray


def test_nothing_cites_design_md():
    citing = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
              if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".sh", ".sbatch"}
              and not {".git", ".venv", "runs"} & set(p.relative_to(REPO).parts) and p != Path(__file__)
              and "DESIGN" + ".md" in p.read_text(errors="replace")]
    assert not citing, citing
