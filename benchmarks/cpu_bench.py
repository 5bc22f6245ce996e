"""The CPU benchmark as a script: the same as `exactlogp bench` (exactlogp.bench.cpu)."""

import sys

from exactlogp.bench.cpu import main

if __name__ == "__main__":
    sys.exit(main())
