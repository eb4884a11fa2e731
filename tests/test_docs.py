"""Docs consistency (no server): API coverage of docs/api.md, README set-up, docstrings."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import types
from pathlib import Path

import pytest

import lmkv_async
import lmkv_async.kernel
import lmkv_async.testing

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
README = ROOT / "README.md"


def _load_demo() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("lmkv_demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


#: Modules whose ``__all__`` is public API, documented in docs/api.md and held to docstrings.
DOCUMENTED = (lmkv_async, lmkv_async.kernel, lmkv_async.testing)
#: Plus the demo's entry point, for docstrings only.
WITH_DOCSTRINGS = (*DOCUMENTED, _load_demo())

_FENCE = re.compile(r"^(```|~~~)")


def _headings(markdown: str) -> set[str]:
    """Every `code span` that appears in a Markdown heading line."""
    names: set[str] = set()
    for line in markdown.splitlines():
        if re.match(r"^#{1,6}\s", line):
            names.update(re.findall(r"`([^`]+)`", line))
    return names


def _public(module: types.ModuleType) -> list[tuple[str, object]]:
    return [(name, getattr(module, name)) for name in module.__all__]


# --------------------------------------------------------------------------- docs/api.md


@pytest.mark.parametrize("module", DOCUMENTED, ids=lambda m: m.__name__)
def test_every_public_name_has_a_heading_in_api_md(module: types.ModuleType) -> None:
    """Each name in ``__all__`` must be the `code` of some heading of docs/api.md."""
    headings = _headings(API_MD.read_text())
    missing = [name for name, _ in _public(module) if name not in headings]
    assert not missing, f"docs/api.md has no heading for {module.__name__}: {missing}"


def test_every_context_method_has_a_heading_and_every_property_is_named() -> None:
    text = API_MD.read_text()
    headings = _headings(text)
    ctx = lmkv_async.AsyncKVContext
    methods = [n for n, v in vars(ctx).items() if not n.startswith("_") and inspect.isfunction(v)]
    props = [n for n, v in vars(ctx).items() if not n.startswith("_") and isinstance(v, property)]
    assert not [m for m in methods if m not in headings], "AsyncKVContext methods without heading"
    assert not [p for p in props if not re.search(rf"`{p}\b", text)], "undocumented properties"


# --------------------------------------------------------------------------- README


def setup_commands(readme: str) -> list[str]:
    """The shell commands in the README's set-up section.

    The section runs from the one level-2 heading ``## Set-up`` to the next level-2
    heading. A fenced block opens with a line starting with ``` (or ~~~), optionally
    followed by an info string, and closes at the next line starting with the same
    fence. Every non-blank line inside such a block is one command, after dropping a
    leading ``$ `` prompt, unless it is a comment (starts with ``#``); lines ending in
    a backslash are joined with the next one. Commands in prose (inline code) do not
    count.
    """
    lines = readme.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"^##\s+Set-up\s*$", line)]
    assert len(starts) == 1, f"expected exactly one '## Set-up' heading, found {len(starts)}"
    section: list[str] = []
    for line in lines[starts[0] + 1 :]:
        if re.match(r"^##\s", line):
            break
        section.append(line)

    commands: list[str] = []
    fence: str | None = None
    pending = ""
    for line in section:
        opening = _FENCE.match(line)
        if fence is None:
            if opening:
                fence = opening.group(1)
            continue
        if line.startswith(fence):
            assert not pending, f"unterminated continuation line {pending!r}"
            fence = None
            continue
        text = line.strip()
        if text.startswith("$ "):
            text = text[2:].strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        commands.append(pending + text)
        pending = ""
    assert fence is None, "unclosed code fence in the set-up section"
    return commands


def test_readme_has_exactly_two_setup_commands() -> None:
    assert setup_commands(README.read_text()) == ["nox -s demo", "nox -s tests"]


def test_setup_command_parser() -> None:
    readme = (
        "# x\n\n## Set-up\n\nInstall with `pip install nox`.\n\n```sh\n$ a \\\n  b\n# note\n\n"
        "c\n```\n\n~~~\nd\n~~~\n\n## Next\n\n```sh\ne\n```\n"
    )
    assert setup_commands(readme) == ["a b", "c", "d"]


def test_readme_benchmarks_section_and_links_exist() -> None:
    text = README.read_text()
    section = re.search(r"^## Benchmarks\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README has no ## Benchmarks section"
    assert "](docs/benchmarks.md)" in section.group(1)
    assert "nox -s bench" in section.group(1)
    for target in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / target).is_file(), f"README links to missing {target}"


def _anchors(markdown: str) -> set[str]:
    """GitHub-style heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors: set[str] = set()
    for line in markdown.splitlines():
        match = re.match(r"^#{1,6}\s+(.*)$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            anchors.add(slug.replace(" ", "-"))
    return anchors


def test_docs_links_and_anchors_resolve() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md|)(?:#([^)\s]+))?\)", text):
            dest = (page.parent / target).resolve() if target else page
            assert dest.is_file(), f"{page.name} links to missing {target}"
            if anchor:
                assert anchor in _anchors(dest.read_text()), f"{page.name} -> {target}#{anchor}"


# --------------------------------------------------------------------------- docstrings


def _doc_missing(obj: object) -> bool:
    doc = obj.__doc__ if isinstance(obj, type) else inspect.getdoc(obj)
    if not doc or not doc.strip():
        return True
    # dataclasses and NamedTuples without a docstring get "Name(field, ...)"
    return isinstance(obj, type) and doc.startswith(f"{obj.__name__}(")


def _undocumented(module: types.ModuleType) -> list[str]:
    missing: list[str] = []
    if _doc_missing(module):
        missing.append(module.__name__)
    for name, obj in _public(module):
        qual = f"{module.__name__}.{name}"
        if isinstance(obj, types.ModuleType):
            if _doc_missing(obj):
                missing.append(qual)
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants, type aliases, __version__
        if _doc_missing(obj):
            missing.append(qual)
        if not inspect.isclass(obj):
            continue
        for member_name, member in vars(obj).items():
            if member_name.startswith("_"):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member) and not (member.__doc__ or "").strip():
                missing.append(f"{qual}.{member_name}")
    return missing


@pytest.mark.parametrize("module", WITH_DOCSTRINGS, ids=lambda m: m.__name__)
def test_public_functions_classes_and_methods_have_docstrings(module: types.ModuleType) -> None:
    missing = _undocumented(module)
    assert not missing, f"missing docstrings: {missing}"
