"""Entry point of `python -m devcluster`."""

from devcluster.cli import main

raise SystemExit(main())
