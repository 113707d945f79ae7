"""python -m engine.bench: see engine/bench/cli.py."""

import sys

from engine.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
