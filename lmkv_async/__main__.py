"""Entry point of the ``lmkv`` console script (also ``python -m lmkv_async``).

It is kept apart from :mod:`lmkv_async.cli` so that a missing ``cli`` extra
(typer, rich) gives one line naming the extra and exit code 5 instead of an
``ImportError`` traceback; :mod:`lmkv_async` itself never needs either.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

#: Exit code when the ``cli`` extra is missing: ``ExitCode.NOT_AVAILABLE`` in
#: :mod:`lmkv_async.cli` (which cannot be imported to read it in that case).
NOT_AVAILABLE = 5


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lmkv`` with ``argv`` (default: ``sys.argv[1:]``); return its exit code."""
    try:
        from . import cli
    except ImportError as exc:
        # cli.py re-raises a missing typer/rich (or their own deps) as ImportError(
        # MISSING_EXTRA) from the original; anything else is a real bug: traceback.
        cause = exc.__cause__
        if not (isinstance(cause, ImportError)
                and (cause.name or "").split(".")[0] in ("typer", "rich", "click")):
            raise
        sys.stderr.write(f"lmkv: error: {exc}\n")
        return NOT_AVAILABLE
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
