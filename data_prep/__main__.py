"""``python -m data_prep``: see :mod:`data_prep.cli`."""

from data_prep.cli import main

raise SystemExit(main())
