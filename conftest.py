"""Root pytest configuration: the text-notebook plugin, and the book's link to the labs."""

pytest_plugins = ["tests.nbval_markdown", "pytester"]

# book/labs is a symlink to labs/ so the site can include the labs; collect them once.
collect_ignore = ["book/labs", "book/_build", "book/student"]
