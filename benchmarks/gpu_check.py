"""The GPU check of the Triton backend as a script (exactlogp.gpucheck.main): bits,
latency, bandwidth and compiled code in one command.

    PYTHONPATH=src python benchmarks/gpu_check.py --out reports/gpu
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/gpu_check.py --tiny --out /tmp/gc
"""

import sys

from exactlogp.gpucheck.main import main

if __name__ == "__main__":
    sys.exit(main())
