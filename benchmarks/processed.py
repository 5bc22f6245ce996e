"""What the exact cut costs: processed logprobs and sample against their baselines.

A script for exactlogp.bench.processed, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.processed import main

if __name__ == "__main__":
    sys.exit(main())
