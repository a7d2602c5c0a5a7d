"""`python -m vramd.cli`: vramctl."""
import sys

from .vramctl import main

sys.exit(main())
