"""``python -m eins ...``: the ``eins`` command (eins/cli.py) without its console script."""
import sys

from eins.cli import main

sys.exit(main())
