"""python -m engine.serve [options]: the same as `engine serve`."""

import sys

from engine.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
