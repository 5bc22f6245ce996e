"""The GPU check of the Triton backend, in one command (benchmarks/gpu_check.py):

bits.py    1. the Triton backend on the device against the reference backend on the
              CPU, forward and backward; the finalize kernel on drawn records; no
              host sync with validate=False
speed.py   2. latency of the registry's candidates at TP1 and of exactlogp's parts
           3. the max pass's achieved bandwidth
ptx.py     4. the kernels compiled for the device's architecture: no FMA, IEEE
              divisions, contract constants (also benchmarks/triton_ptx_check.py,
              which compiles for sm_90 on any machine)
main.py    the command: stages, environment, gpu_check.json and gpu_check.md
"""
