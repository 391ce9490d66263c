# The course's shared nbgrader settings, read by every user's server and every nbgrader command
# run from the course environment (`make course` installs this file as
# .venv/etc/jupyter/nbgrader_config.py). The instructor's ~/.jupyter/nbgrader_config.py adds
# where the course folder is (the recipe in book/course.md writes it).
import os

c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "offload-course"
# Made by the recipe (sticky, writable by everyone, as nbgrader asks); OFFLOADLAB_EXCHANGE moves
# it (the hub passes it on).
c.Exchange.root = os.environ.get("OFFLOADLAB_EXCHANGE", "/srv/nbgrader/exchange")
c.Exchange.path_includes_course = True
# The labs measure and train: a cell may take minutes (nbgrader's default is 30 s). Here, not in
# the instructor's folder, so that a student's Validate runs cells as long as the grader does.
c.Execute.timeout = 600
# Before a submission runs, answer cells that reach for the checks instead of answering are
# replaced by a cell that says why (offloadlab_course/guard.py); nbgrader's own steps otherwise.
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "nbgrader.preprocessors.OverwriteCells",
    "offloadlab_course.guard.ScreenAnswers",
    "nbgrader.preprocessors.CheckCellMetadata",
]
# Feedback shows the scores, never the hidden tests that gave them: nbgrader's default shows
# their source, and a failed check's traceback lists it too.
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbgrader.preprocessors.ClearHiddenTests",
    "offloadlab_course.guard.ClearTracebacks",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
