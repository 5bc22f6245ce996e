"""The exact fused LM head on the CPU, side by side with what a user would run instead.

A script for exactlogp.bench.linear_head, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.linear_head import main

if __name__ == "__main__":
    sys.exit(main())
