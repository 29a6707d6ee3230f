"""`python -m morok_py` runs the `morok` command line."""
import sys

from .cli import main

sys.exit(main())
