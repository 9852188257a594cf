"""CUDA builds: standalone .cu kernels in one shared library (ctypes), one wrapper module per op."""
