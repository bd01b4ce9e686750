"""``python -m coplan.cli``: the same as the ``coplan`` console script."""

from coplan.cli.app import main

if __name__ == "__main__":
    main()
