"""Peak extra memory and time of the reference backend at the Qwen3-Next shape.

A script for exactlogp.bench.reference_memory, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.reference_memory import main

if __name__ == "__main__":
    sys.exit(main())
