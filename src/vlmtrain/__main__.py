"""`python -m vlmtrain ...` is the `vlmtrain` command."""

from vlmtrain.cli import main

raise SystemExit(main())
