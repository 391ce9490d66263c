"""Root pytest configuration: the text-notebook plugin, the groups xdist keeps on one worker, and
the book's link to the labs."""

pytest_plugins = ["tests.nbval_markdown", "tests.worker_groups", "pytester"]

# book/labs is a symlink to labs/ so the site can include the labs; collect them once.
collect_ignore = ["book/labs", "book/_build", "book/student"]
