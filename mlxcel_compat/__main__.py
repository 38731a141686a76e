"""python -m mlxcel_compat: the same as the mlxcel-server command."""

from mlxcel_compat.cli import main

raise SystemExit(main())
