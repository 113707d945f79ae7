"""python -m engine.profile [options] -- command ...: the same as `engine profile`."""

import sys

from engine.profiling.cli import main

if __name__ == "__main__":
    sys.exit(main(["profile", *sys.argv[1:]]))
