"""``python -m data_prep``: see `data_prep.cli`."""

from data_prep.cli import main

raise SystemExit(main())
