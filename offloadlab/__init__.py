"""offloadlab: train models larger than GPU memory by offloading state to CPU memory and NVMe.

The package behind the offloadlab textbook and lab kit. Layers, bottom first (each imports
only those below it):

- base: ``units`` (sizes, bandwidths, times: parsing, validation, formatting), ``files`` (result
  files checked before a run and written atomically);
- models (pure arithmetic, the standard library only): ``memory``, ``overlap``, ``budget``, ``architectures``,
  ``sharding``, ``planner`` (a package), ``engines``;
- machine and transfer engine: ``machine``, ``link`` (CUDA and emulated);
- measurement: ``probe``, ``ladder``, ``experiment``, ``model_count`` (transformers' own parameter
  counts, built on the meta device), ``reference`` (shipped
  and the user's own reference measurements);
- mechanisms: ``cpu_adam``, ``offload`` (``CPUOffloadAdam``), ``prefetch``, ``nvme``;
- for the chapters and labs: ``models`` (a small GPT and its data), ``plots``, ``check``,
  ``student``, ``bench``, ``gpucheck`` and ``cli`` (the ``offloadlab`` command).
"""

__version__ = "0.1.0"
