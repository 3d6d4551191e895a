"""`python -m megadecode ...`: the same as the `megadecode` command."""

import sys

from .cli import main

sys.exit(main())
