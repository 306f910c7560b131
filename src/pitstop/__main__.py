"""``python -m pitstop``: the command-line interface."""

from pitstop.cli import main

raise SystemExit(main())
