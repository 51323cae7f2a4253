"""overlapkernels: communication hidden behind computation, inside the kernels."""
from .parallel import ParallelDims, init_parallel

__version__ = "0.1.0"
__all__ = ["ParallelDims", "init_parallel", "__version__"]
