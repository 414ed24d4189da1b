"""Optional C speedups for torchhal, used where installed (`_guards.c` says why it exists).

torchhal runs the same logic in Python without them; TORCHHAL_PURE_PYTHON_GUARDS=1 makes it do so
even where they are installed.
"""

from torchhal_speedups._guards import Guard, first_admitted

__version__ = "0.2.0"  # 0.2.0: GUARD_API, exact tuples at construction
GUARD_API = 1  # what torchhal checks before using Guard and first_admitted: bump on any change to them
__all__ = ["GUARD_API", "Guard", "first_admitted"]
