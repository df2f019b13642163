"""``python -m ssmc``: the same as the ``ssmc`` command."""

from .cli import main

raise SystemExit(main())
