"""What differs by device, behind one seam: CUDA and CPU (default.py), torch_xla SPMD (xla.py).
The top of the stack below run.py: may import any subpackage but tools, eval and inference.
"""
