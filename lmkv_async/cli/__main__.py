"""``python -m lmkv_async.cli``: run :func:`lmkv_async.cli.main` and exit with its code."""

import sys

from ._app import main

sys.exit(main())
