"""``lmkv``: a command line for LMCache MP servers (extra ``lmkv_async[cli]``: typer + rich).

Commands::

    lmkv ping                      HTTP health, version and one ZMQ round trip, timed
    lmkv status                    version, dialect, capabilities, transport, chunk size,
                                   sessions / locks / objects / memory from /status
    lmkv lookup [FILE|-]           cached prefix of token ids given as JSON
    lmkv events                    tail the server's KV event stream
    lmkv bench                     store / retrieve / lookup at a size and concurrency
    lmkv server                    start a local lmcache server (lmkv_async.testing)

Global options come before the command: ``--url``, ``--http-url``, ``--model``,
``--api-key`` (never printed; ``$LMCACHE_API_KEY`` / ``$LMCACHE_API_KEY_FILE``
work too), ``--timeout``, ``--transport``, ``--json`` and ``--debug``
(``--json`` and ``--debug`` are also accepted after the command). ``--json``
prints one JSON document (``events``: one per line). Errors print as one line,
``lmkv: error: <type>: <message>`` on stderr (with ``--json``, an ``{"error":
...}`` object on stdout), without a traceback unless ``--debug``.

Exit codes (:data:`EXIT_CODES`):

===  ==============================================================
0    success
1    the server failed or answered something unusable
2    usage error or bad input (options, token file, layout)
3    the server is unreachable or did not answer in time
4    authentication failed (HTTP 401: API key missing or wrong)
5    not available: this build or this server lacks the feature
130  interrupted (Ctrl-C), except for ``events`` and ``server``,
     for which Ctrl-C (and SIGTERM) is the normal way to stop (0)
===  ==============================================================

Commands that need a registration (``status``, ``lookup``, ``events``) use
``--layout L,NH,HS,dtype,block`` when given, else the layout an engine
registered for ``--model``, else a one-element probe layout (lookups do not
depend on the geometry: keys hash the model name, world size, tokens and salt).
The package itself never imports this module, typer or rich; without them
importing it raises :class:`ImportError` and the ``lmkv`` console script
(:mod:`lmkv_async.__main__`) prints :data:`MISSING_EXTRA` and exits with 5.
"""

from __future__ import annotations

#: What ``lmkv`` prints (one line, exit code 5) when typer or rich is not installed.
MISSING_EXTRA = "the lmkv command line needs the 'cli' extra: pip install 'lmkv_async[cli]'"

try:
    import rich  # noqa: F401  (tables and progress bars; imported where used)
    import typer  # noqa: F401  (every submodule needs it)
except ImportError as _exc:  # exercised without the extra (tests/test_cli.py)
    # An ImportError, not SystemExit: importing this package is a library call; the
    # console script (lmkv_async.__main__) turns it into one line and exit code 5.
    raise ImportError(MISSING_EXTRA) from _exc

# Only after the check above: a submodule imported first would fail on typer with a
# bare ImportError instead of the one line naming the extra.
from ._app import main  # noqa: E402
from ._exits import EXIT_CODES, ExitCode, exit_code_for  # noqa: E402
from ._options import parse_layout  # noqa: E402

__all__ = ["EXIT_CODES", "MISSING_EXTRA", "ExitCode", "exit_code_for", "main", "parse_layout"]
