"""The docs site's sources (no mkdocs, no network): reference coverage, nav, directives.

``nox -s docs`` builds the site with ``--strict``; these checks run with the test
suite and need neither mkdocs nor its plugins:

* every name in the ``__all__`` of :mod:`lmkv_async` and of each public submodule
  has a ``::: module.name`` directive in ``docs/reference/*.md`` (a directive
  on the defining module's path, e.g. ``lmkv_async.errors.KVCacheError``, counts
  for a re-export too, as it renders the same object);
* every directive names something importable (a typo would only show up when the
  site is built);
* every Markdown page under ``docs/`` is in the ``nav`` of ``mkdocs.yml``, and
  every nav entry exists.

(``tests/test_docs.py`` holds ``docs/api.md``, the hand-written guide, to the same
names; this file is about the generated reference.)
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import types
from pathlib import Path

import pytest

import lmkv_async

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
MKDOCS = ROOT / "mkdocs.yml"

#: Modules whose ``__all__`` the reference must cover (``lmkv_async.cli`` needs
#: the cli extra; it is checked when typer and rich are installed).
PUBLIC_MODULES = ("lmkv_async", "lmkv_async.sync", "lmkv_async.metrics", "lmkv_async.kernel",
                  "lmkv_async.testing", "lmkv_async.testing.plugin", "lmkv_async.wire",
                  "lmkv_async.cli", "lmkv_async.__main__")

_DIRECTIVE = re.compile(r"^:::\s+([A-Za-z_][\w.]*)\s*$", re.M)


def directives(text: str) -> list[str]:
    """The identifiers of mkdocstrings' ``::: identifier`` lines (at column 0)."""
    return _DIRECTIVE.findall(text)


def reference_directives() -> list[str]:
    found: list[str] = []
    for page in sorted(REFERENCE.glob("*.md")):
        found += directives(page.read_text())
    return found


def resolve(path: str) -> object:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _module(name: str) -> types.ModuleType:
    if name == "lmkv_async.cli":
        pytest.importorskip("typer")
        pytest.importorskip("rich")
    return importlib.import_module(name)


def missing_names(module: types.ModuleType, targets: list[str]) -> list[str]:
    """Names of ``module.__all__`` that no directive among ``targets`` documents."""
    paths = set(targets)
    objects: dict[int, str] = {}
    for t in targets:
        try:
            obj = resolve(t)
        except (ImportError, AttributeError):
            continue
        if isinstance(obj, (type, types.FunctionType, types.ModuleType)):
            objects[id(obj)] = t  # identity is meaningful only for these
    missing = []
    for name in module.__all__:
        if f"{module.__name__}.{name}" in paths:
            continue
        if id(getattr(module, name)) in objects and isinstance(
                getattr(module, name), (type, types.FunctionType, types.ModuleType)):
            continue
        missing.append(name)
    return missing


# --------------------------------------------------------------------------- the checks


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_name_is_in_the_reference(name: str) -> None:
    module = _module(name)
    missing = missing_names(module, reference_directives())
    assert not missing, f"docs/reference/*.md has no ::: directive for {name}: {missing}"


def test_every_directive_resolves() -> None:
    targets = reference_directives()
    assert len(targets) > 50
    bad = []
    for t in targets:
        if t.startswith("lmkv_async.cli") and importlib.util.find_spec("typer") is None:
            continue
        try:
            resolve(t)
        except (ImportError, AttributeError) as exc:
            bad.append(f"{t}: {exc}")
    assert not bad, bad


def test_the_check_catches_a_missing_name() -> None:
    # The coverage check itself must fail when a name is dropped from the pages.
    targets = [t for t in reference_directives() if t != "lmkv_async.Fleet"]
    assert missing_names(lmkv_async, targets) == ["Fleet"]
    targets = [t for t in reference_directives() if t != "lmkv_async.__version__"]
    assert missing_names(lmkv_async, targets) == ["__version__"]
    assert "lmkv_async.errors.KVCacheError" not in reference_directives()
    targets = [*(t for t in reference_directives() if t != "lmkv_async.KVCacheError"),
               "lmkv_async.errors.KVCacheError"]  # the defining module's path counts
    assert missing_names(lmkv_async, targets) == []


def nav_pages(config: str) -> list[str]:
    """The ``.md`` files named in ``mkdocs.yml``'s ``nav:`` block (``- x.md``, ``- T: x.md``)."""
    block = re.search(r"^nav:\n((?:[ \t]+.*\n?)+)", config, re.M)
    assert block, "mkdocs.yml has no nav"
    return re.findall(r"^\s*-\s+(?:[^:\n]+:\s+)?(\S+\.md)\s*$", block.group(1), re.M)


def test_every_docs_page_is_in_the_nav() -> None:
    config = MKDOCS.read_text()
    nav = nav_pages(config)
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), "a page is twice in the nav"
    assert [p for p in pages if p not in nav] == [], "docs pages missing from the nav"
    assert [p for p in nav if p not in pages] == [], "nav entries without a page"
    assert re.search(r"^\s+- mkdocstrings", config, re.M)
    assert re.search(r"^\s+name: material\s*$", config, re.M)
    assert re.search(r"^strict: true\s*$", config, re.M)


def test_nav_parser() -> None:
    config = ("site_name: x\nnav:\n  - Home: index.md\n  - Ref:\n      - ref/a.md\n"
              "      - B: ref/b.md\nplugins: []\n")
    assert nav_pages(config) == ["index.md", "ref/a.md", "ref/b.md"]
