"""``python -m data_prep.genotypes harmonise ...`` (see `data_prep.genotypes.cli`)."""

from data_prep.genotypes.cli import main

raise SystemExit(main())
