"""``python -m gfxgraph script.py [args...]``: run a script with gfxgraph enabled."""

import sys

from gfxgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
