"""IPython settings for every kernel of the offloadlab environment (`make env` installs this file
as <env>/etc/ipython/ipython_kernel_config.py, where IPython looks for it).

Figures come out as SVG, in the book's style (offloadlab.plots.STYLE): sharp on any screen,
vector in the PDF, with their text kept as text. The site build, JupyterLab and the nbval run all
start their kernels from this environment, so they all draw the same figures.
"""

c = get_config()  # noqa: F821 (IPython provides it while it loads this file)

c.InlineBackend.figure_formats = {"svg"}
try:
    from offloadlab.plots import STYLE
except ImportError:  # offloadlab is not installed here: matplotlib's own style, still SVG
    pass
else:
    c.InlineBackend.rc = dict(STYLE)
