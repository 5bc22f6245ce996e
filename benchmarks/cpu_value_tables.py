"""Where the CPU backend's value tables pay: per-row time of the partials and grad passes

A script for exactlogp.bench.cpu_value_tables, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.cpu_value_tables import main

if __name__ == "__main__":
    sys.exit(main())
