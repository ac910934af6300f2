"""The documents: they speak of the product and its measurements (no work-item, ticket or device-run vocabulary in
the docs, code, tests, scripts or raw results), every docs/ page is reachable from the README, and every relative
link in README.md, BENCHMARKS.md and docs/*.md points to a file (and heading) that exists."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "BENCHMARKS.md", "docs", "src", "tests", "scripts", "benchmarks")
# Public-domain books bundled as the demo corpus: their English uses these words in their own sense.
CORPUS = "src/paraseek/assets/corpus/"
# Built from pieces so that this file does not match itself.
PROCESS_WORDS = re.compile("|".join([r"call [0-9]+", r"calls [0-9]", "iss" r"ue #?[0-9]+", "accept" "ance",
                                     "the " "issue"]), re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    """The repository's files under SCANNED: git's list (tracked, and new files not ignored) where this is a
    checkout, else a walk of the folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *SCANNED],
                             cwd=ROOT, capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for s in SCANNED for p in ([ROOT / s] if (ROOT / s).is_file()
                                                                    else (ROOT / s).rglob("*")) if p.is_file()]
    return [ROOT / n for n in names if not n.startswith(CORPUS) and (ROOT / n).is_file()]


def text_of(path: Path) -> str | None:
    """The file as UTF-8 text, or None for a binary file (a NUL byte, or bytes that are not UTF-8: plots)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_process_vocabulary_in_docs_code_tests_scripts_or_results():
    hits = []
    for path in tracked_files():
        text = text_of(path)
        for i, line in enumerate((text or "").splitlines(), 1):
            if PROCESS_WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert len(tracked_files()) > 100  # the scan saw the repository
    assert not hits, "say what is measured or checked, and cite the raw file or command:\n" + "\n".join(hits)


def test_the_vocabulary_check_finds_what_it_looks_for():
    for line in ("as measured in c" "all 12", "c" "alls 26-29 found", "see iss" "ue #17", "iss" "ue 16's item",
                 "the accept" "ance test", "The " "issue asks 1.1x"):
        assert PROCESS_WORDS.search(line), line
    for line in ("one all-reduce per call", "a tool call's arguments", "issues of a book", "accepted"):
        assert not PROCESS_WORDS.search(line), line


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors_of(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than - and _ dropped, spaces as hyphens; a repeated
    heading gets -1, -2, ... Headings inside fenced code blocks are not headings."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = re.match(r"(#{1,6}) +(.*?) *#* *$", line)
        if fenced or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[2].lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / t.split("#")[0]).resolve() for t in LINK.findall(readme)}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_relative_links_point_to_existing_files_and_headings():
    broken = []
    for page in markdown_pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
