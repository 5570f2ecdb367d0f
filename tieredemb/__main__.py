"""python -m tieredemb: the `tieredemb` command (tieredemb/cli.py)."""

from .cli import main

raise SystemExit(main())
