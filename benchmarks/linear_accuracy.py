"""Accuracy of the exact fused LM head against fp64, beside the pipelines users run.

A script for exactlogp.bench.linear_accuracy, which holds the code and its options (--help).
"""

import sys

from exactlogp.bench.linear_accuracy import main

if __name__ == "__main__":
    sys.exit(main())
