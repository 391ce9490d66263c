"""The course around offloadlab: what the book and the labs use and a library user never needs.

- :mod:`~offloadlab_course.plots`: the book's figures, in its style;
- :mod:`~offloadlab_course.check` and :mod:`~offloadlab_course.grading`: the labs' checks and
  their measured challenges;
- :mod:`~offloadlab_course.guard`: what keeps the grade out of the answer cells' reach (the
  autograder's screen, the kernel's sealed modules) and the hidden tests out of feedback;
- :mod:`~offloadlab_course.student`: the student release of the labs (``python -m
  offloadlab_course.student``), with nbgrader's metadata when asked;
- :mod:`~offloadlab_course.capacity`: lab 4's device-memory cap;
- :mod:`~offloadlab_course.lab`: the contents manager `make lab` serves the book with.

It imports :mod:`offloadlab`; offloadlab never imports it.
"""
