"""The compiled-code check of the Triton kernels as a script (exactlogp.gpucheck.ptx).

python benchmarks/triton_ptx_check.py [--arch 90] [--quick] [--out DIR]
"""

import sys

from exactlogp.gpucheck.ptx import main

if __name__ == "__main__":
    sys.exit(main())
