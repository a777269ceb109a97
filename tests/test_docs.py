"""The READMEs describe the design and its use, not the history of one machine.

Their Python blocks run as tests too (pytest-markdown-docs, configured in pyproject.toml).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = sorted([ROOT / "README.md", *(ROOT / "src" / "feedline").glob("*/README.md")])

# Things that belong in commit messages and benchmark output, never in a README.
FORBIDDEN = {
    "a path under /tmp": re.compile(r"/tmp/"),
    "a file of this project's workplace": re.compile(r"\.\./shared"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a commit": re.compile(r"\bcommit [0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`"),
    "a session": re.compile(r"\bthis session\b", re.IGNORECASE),
}


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readmes_carry_no_history_of_a_machine(readme: Path) -> None:
    text = readme.read_text()
    found = [
        f"{what}: {match.group(0)!r} (line {text.count(chr(10), 0, match.start()) + 1})"
        for what, pattern in FORBIDDEN.items()
        for match in pattern.finditer(text)
    ]
    assert not found, f"{readme.name}: " + "; ".join(found)


def test_every_readme_with_python_blocks_is_collected() -> None:
    # The plugin runs the blocks of the files pytest is pointed at: testpaths must name them.
    config = (ROOT / "pyproject.toml").read_text()
    assert '"README.md"' in config
    assert '"src/feedline/*/README.md"' in config
    assert "--markdown-docs" in config
    blocks = sum(p.read_text().count("```python") for p in READMES)
    assert blocks >= 7


def test_the_benchmarks_section_is_one_pasted_summary() -> None:
    from feedline.bench._report import MARKERS

    text = (ROOT / "README.md").read_text()
    start, end = (text.index(marker) for marker in MARKERS)
    section = text[start:end]
    assert section.count("- **Command**: `feedline bench") == 1
    assert "- **Machine**: " in section
    assert "### Headline" in section


def test_the_full_report_is_the_same_run_as_the_readme_s_headline() -> None:
    from feedline.bench._report import MARKERS

    def pasted(name: str) -> str:
        text = (ROOT / name).read_text()
        start, end = (text.index(marker) for marker in MARKERS)
        return text[start:end]

    readme, full = pasted("README.md"), pasted("BENCHMARKS.md")
    assert full.startswith(readme)  # header and headline, the same to the letter
    assert "### engine: " in full  # then every scenario's own table
    assert "### engine: " not in readme
    assert len(readme.splitlines()) < 0.3 * len(full.splitlines())
    found = [what for what, pattern in FORBIDDEN.items() if pattern.search(full)]
    assert not found, f"BENCHMARKS.md: {found}"
