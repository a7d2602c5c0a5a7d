"""`python -m vramd`: the daemon (the same as the `vramd` command)."""
import sys

from .service.main import main

sys.exit(main())
