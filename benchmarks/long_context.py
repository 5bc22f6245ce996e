"""Long context: the exact fused LM head against full logits + log_softmax, growing N.

A script for exactlogp.bench.long_context, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.long_context import main

if __name__ == "__main__":
    sys.exit(main())
