"""What contract exactlogp-linear-v2 costs against v1, on the CPU, per input kind.

A script for exactlogp.bench.linear_cost, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.linear_cost import main

if __name__ == "__main__":
    sys.exit(main())
