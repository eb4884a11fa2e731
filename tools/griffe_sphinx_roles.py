"""A griffe extension for the docs site: Sphinx markup in docstrings -> Markdown.

The docstrings are written for ``help()`` and IDEs, with reST roles such as
``:class:`~lmkv_async.StoreResult``` and ``::`` before literal blocks. mkdocstrings
renders Markdown, where those would show verbatim; this turns a role into inline
code (``StoreResult``; the ``~`` form keeps the last component, as Sphinx does)
and a trailing ``::`` into ``:``. Roles become code, not links: a link to a name
the site does not render (``anyio...``) would fail ``mkdocs build --strict``.

Used by mkdocs.yml (``extensions: [tools/griffe_sphinx_roles.py]``); imports griffe,
so only the docs extra needs it.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
_LITERAL = re.compile(r"(\S)::$", re.M)


def convert(text: str) -> str:
    """``text`` with reST roles as inline code and ``word::`` as ``word:``."""

    def role(m: re.Match[str]) -> str:
        target = m.group(2).strip()
        if "<" in target and target.endswith(">"):  # :func:`title <target>`
            return f"`{target.split('<', 1)[0].strip()}`"
        return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"

    return _LITERAL.sub(r"\1:", _ROLE.sub(role, text))


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring as it is loaded (modules, classes, functions, attributes)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
