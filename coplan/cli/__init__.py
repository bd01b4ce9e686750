"""The ``coplan`` command line (``coplan --help`` lists its commands).

``main()`` is the console script. User errors (``coplan.errors.CoplanError``) print as one line,
``error: <message>``, on stderr and exit with the error's ``exit_code``; usage errors exit 2.
"""

from coplan.cli.app import app, main

__all__ = ["app", "main"]
