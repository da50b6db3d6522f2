"""`python -m localspec` is the same as the `localspec` console script."""

from localspec.cli import main

raise SystemExit(main())
