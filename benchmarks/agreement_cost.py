"""What failing closed costs: the forward at the Qwen3-Next shape over a TP4 gloo world.

A script for exactlogp.bench.agreement_cost, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.agreement_cost import main

if __name__ == "__main__":
    sys.exit(main())
