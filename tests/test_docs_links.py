"""The front doors hold together: every relative link and picture in README.md, docs/**/*.md and the READMEs
of benchmarks/ and deploy/ points to a file of the repository (and a `#fragment` to a heading of that page),
every figure under docs/figures/ is small and shown by some page, and every curl in them that sends a JSON
body says `Content-Type: application/json`. Reads files only: no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "benchmarks" / "README.md",
                ROOT / "deploy" / "README.md"])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
MAX_FIGURE_BYTES = 100 * 1024


def prose(page: Path) -> str:
    """The page without its code blocks and code spans, where a bracket is not a link."""
    text = FENCE.sub("", page.read_text())
    return INLINE_CODE.sub("x", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_figures_are_small_and_shown() -> None:
    shown = {(page.parent / target.partition("#")[0]).resolve() for page in PAGES
             for target in relative_links(page)}
    figures = [f for f in (ROOT / "docs" / "figures").iterdir() if f.suffix in {".png", ".svg"}]
    assert figures
    for figure in figures:
        assert figure.stat().st_size <= MAX_FIGURE_BYTES, f"{figure.name}: {figure.stat().st_size} bytes"
        assert figure.resolve() in shown, f"{figure.name} is shown by no page"


def curl_commands(page: Path) -> list[str]:
    """Every curl command in the page's code blocks, its `\\`-continued lines joined."""
    commands = []
    for block in FENCE.findall(page.read_text()):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line for line in joined.splitlines() if re.match(r"\s*curl\b", line)]
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_curl_that_sends_json_says_so(page: Path) -> None:
    """FastAPI reads a body as JSON only under `Content-Type: application/json`; curl's -d sends
    application/x-www-form-urlencoded, and the request is refused (as the deploy README's PUT /admin/pools
    was)."""
    unlabelled = [command for command in curl_commands(page)
                  if re.search(r"\s(-d|--data\S*)\s+'?[{\[]", command)
                  and not re.search(r"-H\s+['\"]content-type:\s*application/json", command, re.IGNORECASE)]
    assert not unlabelled, unlabelled
