"""Small C kernels of our own, compiled on first use (build.py) and called with ctypes."""
