"""IPython settings for every kernel of the offloadlab environment (`make env` installs this file
as <env>/etc/ipython/ipython_kernel_config.py, where IPython looks for it).

Figures come out as SVG, in the book's style (offloadlab_course.plots.STYLE): sharp on any screen,
vector in the PDF, with their text kept as text. The site build, JupyterLab and the nbval run all
start their kernels from this environment, so they all draw the same figures.
"""

import os

c = get_config()  # noqa: F821 (IPython provides it while it loads this file)

c.InlineBackend.figure_formats = {"svg"}
# offloadlab_course.plots imports pyplot, which would settle on a non-interactive backend before the
# kernel names its own: name the inline backend first, as the kernel would.
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
try:
    from offloadlab_course.plots import STYLE
except ImportError:  # offloadlab is not installed here: matplotlib's own style, still SVG
    pass
else:
    c.InlineBackend.rc = dict(STYLE)
