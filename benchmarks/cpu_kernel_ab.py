"""A/B of two versions of the CPU kernels' C source, interleaved in one process.

A script for exactlogp.bench.cpu_kernel_ab, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.cpu_kernel_ab import main

if __name__ == "__main__":
    sys.exit(main())
