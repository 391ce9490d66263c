"""The course page's recipe is the one the kit ships and tests (the page itself runs under nbval;
tests/test_hub.py runs the recipe end to end)."""

import ast
import json
import re

from tests.conftest import ROOT
from tests.test_hub import page_blocks

PAGE = (ROOT / "book" / "course.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
HUB_CONFIG = (ROOT / "course" / "jupyterhub_config.py").read_text(encoding="utf-8")


def test_the_readme_gives_the_same_commands_as_the_course_page():
    section = README.split("**In a course on a GPU server.**", 1)[1].split(
        "\n**As a static site.**", 1
    )[0]
    readme_blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    assert readme_blocks == [commands for _, commands in page_blocks()]


def test_the_hub_configuration_needs_no_docker_and_sets_student_mode_for_students_only():
    tree = ast.parse(HUB_CONFIG)
    assert tree.body and "DockerSpawner" not in HUB_CONFIG and "dockerspawner" not in PAGE.lower()
    assert 'c.Spawner.cmd = [str(ENVIRONMENT / "bin" / "jupyterhub-singleuser")]' in HUB_CONFIG
    assert '"OFFLOADLAB_STUDENT": "0" if name in members(STAFF) else "1"' in HUB_CONFIG
    assert ".get(name)" in HUB_CONFIG  # a user outside the GPU table is no KeyError


def test_the_students_lab_settings_hide_nbgraders_instructor_tools():
    disabled = json.loads(
        (ROOT / "course" / "students" / "labconfig" / "page_config.json").read_text()
    )
    assert set(disabled["disabledExtensions"]) == {
        "@jupyter/nbgrader:formgrader",
        "@jupyter/nbgrader:create-assignment",
        "@jupyter/nbgrader:course-list",
    }


def test_the_gpu_table_on_the_page_is_json():
    tables = re.findall(r"```json\n(.*?)```", PAGE, re.DOTALL)
    assert tables and all(isinstance(json.loads(t.replace("…", "")), dict) for t in tables)


def test_the_nbgrader_commands_name_assignments_that_make_student_writes():
    from offloadlab_course.student import assignment_name, find_labs

    assignments = {assignment_name(p) for p in find_labs(ROOT / "labs")}
    # each command names the week's lab, LAB, whose default the block sets
    commands = re.findall(
        r"nbgrader (?:generate_assignment|release_assignment|collect|autograde|"
        r"generate_feedback|release_feedback) (\S+)",
        PAGE,
    )
    defaults = set(re.findall(r"LAB=\$\{LAB:-(\w+)\}", PAGE))
    assert commands and set(commands) == {'"$LAB"'}, commands
    assert defaults and defaults <= assignments


def test_the_page_says_what_limits_pinned_memory_and_the_hub_does_not_raise_ulimit_l():
    """CUDA's pinned memory is not charged to RLIMIT_MEMLOCK (NVIDIA's driver pins pages itself
    and never reads it): raising ``ulimit -l`` is no step of the recipe, and the page says why,
    naming the sources, and what does bound pinned memory."""
    assert "setrlimit" not in HUB_CONFIG and "RLIMIT_MEMLOCK" in HUB_CONFIG  # said, not done
    hub = PAGE.split("(course-hub)=", 1)[1].split("\n(", 1)[0]
    for source in ("os-mlock.c", "mm/mlock.c", "drivers/infiniband/core/umem.c", "CAP_IPC_LOCK"):
        assert source in hub, source
    assert "cgroup" in hub and "CUDA error 2" in hub
    assert "lifts the cap" not in PAGE and "should print `unlimited`" not in PAGE


def test_the_systemd_unit_runs_the_recipes_hub_command():
    import configparser

    unit = configparser.ConfigParser()
    unit.optionxform = str  # systemd's keys are case-sensitive
    unit.read_string(re.search(r"```ini\n(.*?)```", PAGE, re.DOTALL).group(1))
    service = unit["Service"]
    hub = page_blocks()[3][1]
    course = re.search(r"COURSE=\$\{COURSE:-(\S+)\}", hub).group(1)
    folder = re.search(r"&& cd (\S+)", hub).group(1)
    command = hub.split(f"cd {folder}\n", 1)[1].replace("\\\n", " ")
    command = " ".join(command.replace('"$COURSE', course).replace('"', "").split())
    environment, started = command.split(" ", 1)
    assert service["WorkingDirectory"] == folder
    exec_start = " ".join(service["ExecStart"].replace("\\", " ").split())  # a line continued
    assert service["Environment"] == environment and exec_start == started
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # the hub makes each user's control group below its own (offloadlab_course.limits)
    assert (
        service["Delegate"] == "yes" and "c.JupyterHub.spawner_class = LimitedSpawner" in HUB_CONFIG
    )
