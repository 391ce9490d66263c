# The course's shared nbgrader settings, read by every user's server and every nbgrader command
# run from the course environment (`make course` installs this file as
# .venv/etc/jupyter/nbgrader_config.py). The instructor's own nbgrader_config.py, in the course
# folder, adds the course folder's settings on top.
import os

c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "offload-course"
# Made by the recipe, writable by everyone as nbgrader asks; OFFLOADLAB_EXCHANGE moves it (the hub passes it on).
c.Exchange.root = os.environ.get("OFFLOADLAB_EXCHANGE", "/srv/nbgrader/exchange")
c.Exchange.path_includes_course = True
