"""What the fused LM head's hidden-state agreement costs (row_hash against the forward).

A script for exactlogp.bench.row_hash, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.row_hash import main

if __name__ == "__main__":
    sys.exit(main())
