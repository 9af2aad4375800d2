"""The user-facing docs stay self-contained, resolvable and short.

A newcomer reads README.md, docs/*.md, BENCHMARKS.md and each console script's ``--help``. Every
relative link and every repository path they mention must exist in this repository, none may point
outside it (``../``) or at a file that only ever lived next to it (``SEEDS.md``, ``PPO_SEMANTICS.md``,
``DESIGN.md``), and none may speak in internal history (``issue 8``, a commit id) or date itself
("today", "the day before"). docs/ holds the pages and the few figures they show; curves, run records
and the notebooks' figures live in docs/data/. Presets, code docstrings and comments are held to the
no-outside-file rule too, since their text reaches users through ``--help`` and the source. The scripts
come from pyproject.toml's ``[project.scripts]`` and each parser from its module's ``build_parser()``,
so a new script is checked without editing this file.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
# docs/ holds the pages and the few figures they show prominently; curves, run records and the
# notebook's figures live in docs/data/.
DOCS_ROOT_MAX_IMAGES = 12
IMAGE_SUFFIXES = {".png", ".gif", ".jpg", ".jpeg", ".svg", ".webp"}

# Files that never were part of this repository but were cited as if they were.
FOREIGN = re.compile(r"\b(?:SEEDS|PPO_SEMANTICS|DESIGN)\.md\b|\.\./shared\b")
# A path that climbs (../x): fine from docs/ to the repository root, not past it.
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+[\w./-]*)")
# A path inside the repository: one of its top-level folders, then more path.
ROOTS = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith("."))
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*)" % "|".join(map(re.escape, ROOTS)))
# A bare file name of a top-level document (README.md, BENCHMARKS.md, LICENSE ...).
BARE_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md)\b")
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
# A commit id: 7-40 hex digits with at least one letter and one digit (so 1024 or "deadbeef" are not).
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
# Words that date a page the day it was written: the docs state the current result, its command and machine.
DATED = re.compile(r"\b(?:today|yesterday|a few versions ago|the day before)\b", re.IGNORECASE)
# Folders a run creates (not in a fresh clone) and placeholders a text uses for the user's own files.
GENERATED = ("runs/",)


def _help_texts() -> dict[str, str]:
    texts = {}
    for name, target in SCRIPTS.items():
        module = importlib.import_module(target.split(":")[0])
        parser = module.build_parser()
        texts[f"{name} --help"] = parser.format_help()
        texts[f"{name} --help-all"] = parser.format_full_help()
    return texts


def _texts() -> dict[str, str]:
    texts = {str(p.relative_to(REPO)): p.read_text() for p in DOCS}
    texts.update(_help_texts())
    return texts


def _resolves(path: str, base: Path) -> bool:
    path = path.split("#")[0].rstrip(".,;:)'`")
    path = re.sub(r"(\.\w+):\d+(?:-\d+)?$", r"\1", path)  # file.py:270-290 names lines of file.py
    if not path or path.startswith(GENERATED):
        return True
    if "." not in path.rsplit("/", 1)[-1] and not path.endswith("/"):
        return True  # no extension: a metric name such as learner/skipped_updates, not a file
    if "*" in path:
        return any(base.glob(path)) or any(REPO.glob(path))
    return (base / path).exists() or (REPO / path).exists()


def _inside(base: Path, path: str) -> bool:
    return (base / path.split("#")[0]).resolve().is_relative_to(REPO.resolve())


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return _texts()


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"
    )


def test_every_relative_link_resolves():
    bad = []
    for doc in DOCS:
        for target in MD_LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            if not _inside(doc.parent, target) or not _resolves(target, doc.parent):
                bad.append(f"{doc.relative_to(REPO)}: ({target})")
    assert not bad, "links that do not resolve inside the repository:\n" + "\n".join(bad)


def test_every_repository_path_mentioned_exists(texts):
    bad = []
    for where, text in texts.items():
        for path in REPO_PATH.findall(text):
            if not _resolves(path, REPO):
                bad.append(f"{where}: {path}")
        for name in BARE_DOC.findall(text):
            if not ((REPO / name).exists() or (REPO / "docs" / name).exists()):
                bad.append(f"{where}: {name}")
    assert not bad, "paths that name no file of this repository:\n" + "\n".join(sorted(set(bad)))


def test_nothing_names_a_file_outside_the_repository(texts):
    sources = [
        p
        for d in ("impala", "actors", "learner", "scripts", "configs", "deploy")
        for p in (REPO / d).rglob("*")
        if p.is_file()
        and p.suffix in {".py", ".yaml", ".yml", ".sh", ".md", ""}
        and "__pycache__" not in p.parts
    ]
    everything = dict(texts)
    everything.update({str(p.relative_to(REPO)): p.read_text(errors="replace") for p in sources})
    everything["pyproject.toml"] = (REPO / "pyproject.toml").read_text()
    base = {where: (REPO / where).parent if (REPO / where).is_file() else REPO for where in everything}
    bad = [
        f"{where}: {line.strip()[:160]}"
        for where, text in everything.items()
        for line in text.splitlines()
        if FOREIGN.search(line) or any(not _inside(base[where], p) for p in CLIMB.findall(line))
    ]
    assert not bad, "text that cites a file outside this repository:\n" + "\n".join(bad)


def test_user_docs_speak_of_features_not_history(texts):
    bad = [
        f"{where}: {m.group(0)!r} in {line.strip()[:120]!r}"
        for where, text in texts.items()
        for line in text.splitlines()
        for m in [*ISSUE.finditer(line), *COMMIT.finditer(line)]
    ]
    assert not bad, "issue numbers or commit ids in user-facing text:\n" + "\n".join(bad)


def test_docs_root_holds_pages_and_a_few_figures():
    root = REPO / "docs"
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    stray = [p.name for p in entries if p.is_dir() and p.name != "data"]
    stray += [p.name for p in entries if p.is_file() and p.suffix not in {".md", *IMAGE_SUFFIXES}]
    assert not stray, f"docs/ holds only pages and figures; data goes under docs/data/: {sorted(stray)}"
    images = sorted(p.name for p in entries if p.is_file() and p.suffix in IMAGE_SUFFIXES)
    assert len(images) <= DOCS_ROOT_MAX_IMAGES, (
        f"docs/ holds {len(images)} figures (limit {DOCS_ROOT_MAX_IMAGES}); move the notebook's figures "
        f"under docs/data/: {images}"
    )
    shown = "\n".join(doc.read_text() for doc in DOCS)
    unshown = [name for name in images if name not in shown]
    assert not unshown, f"figures in docs/ that no page shows (move them under docs/data/): {unshown}"


def test_pages_do_not_date_themselves():
    bad = [
        f"{page.relative_to(REPO)}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}"
        for page in DOCS
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in DATED.finditer(line)
    ]
    assert not bad, "say the result, its command and machine, not when it was written:\n" + "\n".join(bad)
