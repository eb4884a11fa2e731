"""The typer application and :func:`main`: parse, dispatch, map usage errors to exit code 2."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

import typer

from ._bench import bench
from ._events import events
from ._exits import ClickException, ExitCode, is_named
from ._options import global_options, options
from ._queries import lookup, ping, status
from ._server import server


def build_app() -> typer.Typer:
    """The typer application (commands registered without decorators, so it stays typed)."""
    app = typer.Typer(
        name="lmkv", add_completion=False, no_args_is_help=True,
        pretty_exceptions_enable=False,  # never print locals (the API key)
        context_settings={"help_option_names": ["-h", "--help"]},
        help=("Talk to an LMCache multiprocess KV-cache server. Exit codes: 0 ok, 1 server "
              "error, 2 usage/bad input, 3 unreachable/timeout, 4 auth, 5 not available, "
              "130 interrupted."),
    )
    app.callback()(global_options)
    for fn in (ping, status, lookup, events, bench, server):
        app.command(fn.__name__)(fn)
    return app


def main(argv: Iterable[str] | None = None) -> int:
    """Run ``lmkv`` with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    app = build_app()
    options.reset()
    try:
        rv = app(args=args, prog_name="lmkv", standalone_mode=False)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:
        if is_named(exc, "Exit"):  # --help, --version
            return int(getattr(exc, "exit_code", 0) or 0)
        if is_named(exc, "Abort"):
            return int(ExitCode.INTERRUPTED)
        if not isinstance(exc, ClickException):
            raise
        # usage errors: one line, minus click's help block
        message = exc.format_message()  # type: ignore[attr-defined]
        if not message:  # no command: click printed the help already
            return int(ExitCode.USAGE)
        if "--json" in args:
            sys.stdout.write(json.dumps({"error": {"type": "UsageError", "message": message,
                                                   "exit_code": int(ExitCode.USAGE)}}) + "\n")
        else:
            sys.stderr.write(f"lmkv: error: {message} (see lmkv --help)\n")
        return int(ExitCode.USAGE)
    return int(rv) if isinstance(rv, int) else 0
