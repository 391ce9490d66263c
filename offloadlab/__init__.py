"""offloadlab: train models larger than GPU memory by offloading state to CPU memory and NVMe.

The package behind the offloadlab textbook and lab kit. Modules, bottom layer first:
``units`` (sizes, bandwidths, times), ``memory`` (the memory wall), ``models`` (a small
GPT for the labs), ``plots`` (the book's figures) and ``cli`` (the ``offloadlab`` command).
"""

__version__ = "0.1.0"
