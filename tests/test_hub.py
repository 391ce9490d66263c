"""The course page's hub recipe, run as written, with real users, end to end (book/course.md).

The test takes the page's shell blocks in order and runs them: the root blocks with bash, the
staff's with ``runuser`` as the grading account (as its terminal would), the hub's in the
background. It skips only
the ``apt-get`` line (.ci/run installs those packages) and the ``git clone``, for which it
copies the checkout under test to where the page clones it. What students do in Lab it does
through the hub, with each student's own token: spawn their server, fetch each of two labs
(1 and 3, the instructor's blocks run once for each, as the page says) from the Assignments
tab's endpoint, run it cell by cell in a kernel of their server, save it as Lab does, submit,
and fetch the feedback. Then it checks the grades: the solved lab scores every automatic point,
the untouched one (whose first answer rebinds a check) none; the grading server (a hub service
running as the grading account) lists the course for the instructor and the TA, who each grade
one lab's reflections in its Formgrader, and refuses students; nobody's own server has the
instructor tools; a student outside the GPU slice table got a server without a GPU and a line in
the hub's log saying why.

It needs root (accounts, and a hub that starts servers as other users) and the network of the
package registries (``make course`` installs into a fresh environment); without root it is
skipped, and CI runs it as root. Each stage's seconds go to build/hub-stages.json.
"""

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import nbformat
import pytest

from offloadlab_course.limits import remove
from offloadlab_course.student import assignment_name, find_labs, source_notebook
from tests.conftest import ROOT

PAGE = ROOT / "book" / "course.md"
# Two labs, each released, worked, submitted, graded and fed back: lab 1 (arithmetic and a
# measured challenge) and lab 3 (a measured transfer).
LABS = {
    assignment_name(p): p for p in find_labs(ROOT / "labs") if p.stem.startswith(("lab01", "lab03"))
}
COURSE_ID = "offload-course"
LAB = LABS["lab01"]  # where one lab will do: the dishonest student's reading
# Accounts of this run alone (two runs on one host once deleted each other's users): their
# processes are the only ones the test ends.
RUN = secrets.token_hex(3)
SOLVED, UNSOLVED, INSTRUCTOR = f"olab{RUN}-ada", f"olab{RUN}-grace", f"olab{RUN}-teacher"
ABSENT = f"olab{RUN}-hopper"  # on the roster, never logs in
TA, GRADER = f"olab{RUN}-ta", f"olab{RUN}-grader"  # a TA; the account the grading server runs as
GRADER_HOME = Path(f"/home/{GRADER}")
SERVICE = f"/services/{COURSE_ID}"  # the grading server, as staff reach it through the hub
THREADS = 1  # OFFLOADLAB_THREADS: each server's CPU threads
MEMORY_LIMIT = 2 * 2**30  # OFFLOADLAB_MEMORY_LIMIT: each server's memory, kernels included
# no GPU here: CUDA_VISIBLE_DEVICES is only passed on
FAKE_SLICE = "MIG-00000000-test-0000-0000-000000000000"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: local accounts and a hub that spawns as them"
)


def page_blocks() -> list[tuple[str, str]]:
    """(who, commands) for each shell block of the recipe, in order: who is the bold lead-in's
    "As root" or "As the instructor"."""
    recipe = (
        PAGE.read_text(encoding="utf-8")
        .split("## The hub, step by step", 1)[1]
        .split("\n## ", 1)[0]
    )
    blocks = []
    for lead, body in re.findall(
        r"\*\*\d+\. (As [^:,.]+)[^*]*\*\*.*?```bash\n(.*?)```", recipe, re.DOTALL
    ):
        blocks.append(("root" if lead == "As root" else "instructor", body))
    return blocks


def runnable(commands: str) -> str:
    """The block without the two lines the test does itself: Debian's packages and the clone."""
    return "\n".join(
        line for line in commands.splitlines() if not line.startswith(("apt-get ", "git clone "))
    )


class Stages:
    """Seconds per stage, written to build/hub-stages.json as they accrue."""

    def __init__(self):
        self.seconds, self.started = {}, time.monotonic()
        self.out = ROOT / "build" / "hub-stages.json"

    def __call__(self, name):
        stages = self

        class Stage:
            def __enter__(self):
                self.start = time.monotonic()

            def __exit__(self, *exc):
                stages.seconds[name] = round(time.monotonic() - self.start, 1)
                stages.seconds["total"] = round(time.monotonic() - stages.started, 1)
                stages.out.parent.mkdir(exist_ok=True)
                stages.out.write_text(json.dumps(stages.seconds, indent=1) + "\n")

        return Stage()


def end_with_its_children(process: subprocess.Popen) -> None:
    """Stop the hub and what it started: its proxy runs in a session of its own and outlived a
    hub that was killed (a failed run under load left configurable-http-proxy running)."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hub:
    """The running hub: REST calls with the course's admin token, or a user's own token."""

    def __init__(self, url: str, token: str, log: Path):
        self.url, self.token, self.log = url, token, log
        self.user_tokens: dict[str, str] = {}

    def call(self, path, body=None, method=None, token=None, form=False, timeout=120):
        data = None
        headers = {"Authorization": f"token {token or self.token}"}
        if body is not None and form:
            data = urllib.parse.urlencode(body).encode()
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        elif body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers=headers,
            method=method or ("POST" if data is not None else "GET"),
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
        try:
            return json.loads(text)  # nbgrader's endpoints answer JSON as text/html
        except ValueError:
            return text

    def status(self, path, token) -> int:
        try:
            self.call(path, token=token)
            return 200
        except urllib.error.HTTPError as error:
            return error.code

    def add_token(self, user: str) -> None:
        """A token of the user's own, as their browser session would have (made by the recipe's
        token service; a user not logged in yet is added first)."""
        if self.status(f"/hub/api/users/{user}", None) == 404:
            self.call(f"/hub/api/users/{user}", {}, method="POST")
        self.user_tokens[user] = self.call(
            f"/hub/api/users/{user}/tokens", {"note": "hub test", "expires_in": 3600}, method="POST"
        )["token"]

    def spawn(self, user: str) -> None:
        """Start the user's server as an admin script would (the recipe's token service)."""
        self.add_token(user)
        try:
            self.call(f"/hub/api/users/{user}/server", {}, method="POST")
        except urllib.error.HTTPError as error:
            assert error.code in (201, 202), (
                f"spawning {user}: HTTP {error.code}: {error.read().decode()[:500]}"
            )

    def wait_ready(self, user: str, seconds: float = 180) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            model = self.call(f"/hub/api/users/{user}")
            server = model.get("servers", {}).get("", {})
            if server.get("ready"):
                return
            if not server.get("pending") and not server:
                break
            time.sleep(0.5)
        pytest.fail(f"{user}'s server did not start:\n" + self.log.read_text()[-3000:])

    def grading(self, staff: str, path: str, body=None, method=None):
        """A request to the grading server, as the member of staff ``staff``."""
        return self.call(f"{SERVICE}{path}", body, method=method, token=self.user_tokens[staff])

    def wait_for_grading_server(self, seconds: float = 180) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.status(f"{SERVICE}/api/status", self.user_tokens[INSTRUCTOR]) == 200:
                return
            time.sleep(0.5)
        pytest.fail("the grading server did not start:\n" + self.log.read_text()[-3000:])

    def user(self, user: str, path: str, body=None, method=None, form=False, timeout=300):
        return self.call(
            f"/user/{user}{path}",
            body,
            method=method,
            token=self.user_tokens[user],
            form=form,
            timeout=timeout,
        )


def run_cells(hub: Hub, user: str, path: str, cells: list[str]) -> list[dict]:
    """Run ``cells`` in a new kernel of ``user``'s server, started on ``path`` as Lab starts one;
    each cell's outputs, as Jupyter messages' contents, and the kernel's exit afterwards."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    session = hub.user(
        user,
        "/api/sessions",
        {"path": path, "type": "notebook", "name": Path(path).name, "kernel": {"name": "python3"}},
        method="POST",
    )
    kernel = session["kernel"]["id"]
    url = hub.url.replace("http", "ws", 1) + f"/user/{user}/api/kernels/{kernel}/channels"

    async def talk():
        request = HTTPRequest(
            url, headers={"Authorization": f"token {hub.user_tokens[user]}"}, connect_timeout=60
        )
        socket_ = await websocket_connect(request)
        results = []
        for code in cells:
            msg_id = secrets.token_hex(8)
            socket_.write_message(
                json.dumps(
                    {
                        "header": {
                            "msg_id": msg_id,
                            "msg_type": "execute_request",
                            "username": user,
                            "session": secrets.token_hex(8),
                            "version": "5.3",
                            "date": "",
                        },
                        "parent_header": {},
                        "metadata": {},
                        "channel": "shell",
                        "buffers": [],
                        "content": {
                            "code": code,
                            "silent": False,
                            "store_history": True,
                            "user_expressions": {},
                            "allow_stdin": False,
                            "stop_on_error": False,
                        },
                    }
                )
            )
            outputs, reply, idle = [], None, False
            while reply is None or not idle:
                message = json.loads(await asyncio.wait_for(socket_.read_message(), 600))
                if message.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = message["header"]["msg_type"]
                if kind in ("stream", "execute_result", "display_data", "error"):
                    outputs.append({"output_type": kind, **message["content"]})
                elif kind == "execute_reply":
                    reply = message["content"]
                elif kind == "status" and message["content"]["execution_state"] == "idle":
                    idle = True
            results.append({"outputs": outputs, "status": reply["status"]})
        socket_.close()
        return results

    try:
        return asyncio.run(talk())
    finally:
        hub.user(user, f"/api/sessions/{session['id']}", method="DELETE")


def as_jupyter_output(output: dict):
    kind = output.pop("output_type")
    if kind == "stream":
        return nbformat.v4.new_output("stream", name=output["name"], text=output["text"])
    if kind == "error":
        return nbformat.v4.new_output(
            "error", ename=output["ename"], evalue=output["evalue"], traceback=output["traceback"]
        )
    return nbformat.v4.new_output(
        kind,
        data=output.get("data", {}),
        metadata=output.get("metadata", {}),
        **({"execution_count": output.get("execution_count")} if kind == "execute_result" else {}),
    )


def work_on(hub: Hub, user: str, solve: bool, assignment: str) -> dict:
    """What a student does in Lab: open the fetched lab, fill in the answers (or not), run every
    cell, save. Returns the environment the student's kernel saw."""
    lab = LABS[assignment]
    path = f"{COURSE_ID}/{assignment}/{lab.stem}.ipynb"
    notebook = nbformat.from_dict(
        hub.user(user, f"/api/contents/{path}?type=notebook&content=1")["content"]
    )
    if solve:  # the worked answers, cell by cell, where the release has stubs
        answers = {
            c.metadata["nbgrader"]["grade_id"]: c.source
            for c in source_notebook(lab).cells
            if c.metadata.get("nbgrader", {}).get("solution")
        }
        for cell in notebook.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id in answers and cell.metadata["nbgrader"].get("solution"):
                cell.source = answers[grade_id]
    else:  # the other student leaves the lab blank but for a first answer that rebinds a check
        first = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("solution"))
        first.source = REBINDING
    code = [c for c in notebook.cells if c.cell_type == "code"]
    probe = (
        "import json, os, sys, torch\nprint(json.dumps({'python': sys.executable, "
        "'threads': torch.get_num_threads(), "
        "'student': os.environ.get('OFFLOADLAB_STUDENT'), 'gpu': "
        "os.environ.get('CUDA_VISIBLE_DEVICES'), 'note': os.environ.get('OFFLOADLAB_GPU_NOTE', "
        "'')}))"
    )
    results = run_cells(hub, user, path, [probe] + [c.source for c in code])
    seen = json.loads(results[0]["outputs"][0]["text"])
    for cell, result in zip(code, results[1:]):
        cell.outputs = [as_jupyter_output(dict(o)) for o in result["outputs"]]
    failed = [i for i, r in enumerate(results[1:]) if r["status"] != "ok"]
    assert bool(failed) != solve, f"{user}: cells that failed: {failed}"
    hub.user(
        user,
        f"/api/contents/{path}",
        {"type": "notebook", "format": "json", "content": notebook},
        method="PUT",
    )
    return seen


# Her kernel refuses it (the course's modules are sealed there), and the grader's screen does
# not run it: her feedback says so.
REBINDING = "check.answer = lambda *args, **kwargs: True\nprediction_fp32_adam = 1"


def fetch_work_submit(hub: Hub, student: str, solve: bool, assignment: str) -> dict:
    """A student's part, through their own server: fetch, work (see work_on), validate the
    solved lab as the Assignments tab does, submit."""
    form = {"course_id": COURSE_ID, "assignment_id": assignment}
    listed = hub.user(student, "/assignments/fetch", form, method="POST", form=True)
    assert listed["success"], listed
    assert any(
        a["assignment_id"] == assignment and a["status"] == "fetched" for a in listed["value"]
    ), listed
    seen = work_on(hub, student, solve, assignment)
    if solve:  # with nbgrader's own 30 s a cell, a correct lab 1 "failed" here
        path = f"{COURSE_ID}/{assignment}/{LABS[assignment].stem}.ipynb"
        validated = hub.user(
            student, "/assignments/validate", {"path": path}, method="POST", form=True, timeout=900
        )
        assert validated["success"] and not validated["value"].get("failed"), validated
    listed = hub.user(student, "/assignments/submit", form, method="POST", form=True)
    assert listed["success"], listed
    assert any(
        a["assignment_id"] == assignment and a["status"] == "submitted" for a in listed["value"]
    ), listed
    return seen


# A whole class (make course, three servers, two labs collected and autograded) takes about 200 s
# on an idle two-core machine and 930 s with five busy processes beside it: the suite's 900 s is a
# guard against a hang, and this test's is twelve idle runs long.
@pytest.mark.timeout(2400)
def test_the_course_page_recipe_runs_a_class_end_to_end():
    import psutil

    stages = Stages()
    blocks = page_blocks()
    assert [who for who, _ in blocks] == ["root"] * 4 + ["instructor"] * 3, blocks
    # a folder to keep between runs, when debugging this test
    kept = os.environ.get("OFFLOADLAB_HUB_TEST_DIR")
    base = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="offloadlab-hub-"))
    base.mkdir(parents=True, exist_ok=True)
    # the course, its environment and the exchange must be readable by the students
    base.chmod(0o755)
    course, exchange, state = base / "offloadlab", base / "exchange", base / "hub"
    shutil.rmtree(exchange, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir()
    hub_log = base / "hub.log"
    port, proxy_port, token = free_port(), free_port(), secrets.token_hex(16)
    (base / "slices.json").write_text(json.dumps({SOLVED: FAKE_SLICE}))
    env = {
        **os.environ,
        "COURSE": str(course),
        "OFFLOADLAB_EXCHANGE": str(exchange),
        "STUDENTS": f"{SOLVED} {UNSOLVED} {ABSENT}",
        "OFFLOADLAB_THREADS": str(THREADS),
        "OFFLOADLAB_MEMORY_LIMIT": f"{MEMORY_LIMIT // 2**20} MiB",
        "INSTRUCTOR": INSTRUCTOR,
        "TAS": TA,
        "OFFLOADLAB_GRADER": GRADER,
        "OFFLOADLAB_GRADER_URL": f"http://127.0.0.1:{free_port()}",
        "OFFLOADLAB_HUB_URL": f"http://127.0.0.1:{port}",
        "OFFLOADLAB_PROXY_API_URL": f"http://127.0.0.1:{proxy_port}",
        "OFFLOADLAB_HUB_TOKEN": token,
        "OFFLOADLAB_GPU_SLICES": str(base / "slices.json"),
    }
    hub_process = None
    try:
        with stages("copy the checkout"):
            listed = (
                subprocess.run(
                    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                    cwd=ROOT,
                    capture_output=True,
                    check=True,
                )
                .stdout.decode()
                .split("\0")
            )
            for name in filter(None, listed):
                source = ROOT / name
                if source.is_file() and not source.is_symlink():
                    (course / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, course / name)
                elif source.is_symlink() and not (course / name).is_symlink():
                    (course / name).parent.mkdir(parents=True, exist_ok=True)
                    (course / name).symlink_to(os.readlink(source))
            # a stand-in for the history a clone has (the copy has none): the recipe keeps it
            (course / ".git").mkdir(exist_ok=True)
            (course / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
            subprocess.run(["chmod", "-R", "a+rX", str(course)], check=True)
        names = ["packages and proxy", "make course", "accounts and exchange"]
        for (who, commands), name in zip(blocks[:3], names):
            if (
                kept
                and name == "make course"
                and (course / ".venv" / "bin" / "jupyterhub-singleuser").exists()
            ):
                continue  # debugging with a kept folder: its environment is already made
            with stages(name):
                result = subprocess.run(
                    ["bash", "-euo", "pipefail", "-c", runnable(commands)],
                    env=env,
                    cwd=base,
                    capture_output=True,
                    text=True,
                )
                assert result.returncode == 0, (
                    f"{name}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
                )
        with stages("start the hub"):
            hub_commands = runnable(blocks[3][1]).replace("/srv/jupyterhub", str(state))
            hub_process = subprocess.Popen(
                [
                    "bash",
                    "-euo",
                    "pipefail",
                    "-c",
                    f"exec {hub_commands.strip()}"
                    if "\n" not in hub_commands.strip()
                    else hub_commands,
                ],
                env=env,
                cwd=base,
                stdout=hub_log.open("w"),
                stderr=subprocess.STDOUT,
            )
            hub = Hub(f"http://127.0.0.1:{port}", token, hub_log)
            for _ in range(240):
                try:
                    hub.call("/hub/api/")
                    break
                except (OSError, urllib.error.HTTPError):
                    assert hub_process.poll() is None, (
                        "the hub exited:\n" + hub_log.read_text()[-3000:]
                    )
                    time.sleep(0.5)
        # The students' servers start while the instructor makes the release, which neither waits
        # for; the instructor's starts once the course folder it serves exists, as in a class.
        with stages("spawn three servers, and the instructor's course and release meanwhile"):
            for user in (SOLVED, UNSOLVED):
                hub.spawn(user)
            with stages("instructor: course and release"):
                for assignment in LABS:  # the block once a lab, as the page says
                    instructor(blocks[4][1], env, assignment)
            # A table broken by hand (a trailing comma) costs the next server its GPU, not a start.
            (base / "slices.json").write_text(json.dumps({SOLVED: FAKE_SLICE})[:-1] + ",}")
            hub.spawn(INSTRUCTOR)
            for user in (SOLVED, UNSOLVED, INSTRUCTOR):
                hub.wait_ready(user)
        broken = rf"no GPU for {INSTRUCTOR} \(the GPU slice table \S+ could not be read"
        assert re.search(broken, hub_log.read_text())
        # The instructor tools in the grading server, for staff only, and no error for anybody;
        # its Formgrader finds the course (an empty one answers 200 too), for the instructor and
        # the TA alike.
        hub.add_token(TA)
        hub.wait_for_grading_server()
        for staff in (INSTRUCTOR, TA):
            listed = hub.grading(staff, "/formgrader/api/assignments")
            assert sorted(a["name"] for a in listed) == sorted(
                assignment_name(path) for path in find_labs(ROOT / "labs")
            ), listed
            assert all(next(a for a in listed if a["name"] == name)["id"] for name in LABS), listed
        assert "@jupyter/nbgrader:create-assignment" not in disabled_extensions(
            hub.grading(TA, "/lab")
        )
        for student in (SOLVED, UNSOLVED):
            assert hub.status(f"{SERVICE}/formgrader", hub.user_tokens[student]) == 403
        for user in (SOLVED, UNSOLVED, INSTRUCTOR):
            assert hub.status(f"/user/{user}/formgrader", hub.user_tokens[user]) == 404
            page = hub.user(user, "/lab")
            assert "@jupyter/nbgrader:create-assignment" in disabled_extensions(page)
            assert "@jupyter/nbgrader:assignment-list" not in disabled_extensions(page)
        # at once, as a class does: each in their own server
        with stages("students fetch, run and submit"):
            with concurrent.futures.ThreadPoolExecutor(2) as pool:

                def both_labs(student, solve):
                    seen = [fetch_work_submit(hub, student, solve, name) for name in LABS]
                    return seen[0]  # (one server: what its kernel saw is the same for each)

                working = {
                    student: pool.submit(both_labs, student, solve)
                    for student, solve in ((SOLVED, True), (UNSOLVED, False))
                }
                seen = {student: future.result() for student, future in working.items()}
        python = str(course / ".venv" / "bin" / "python")
        for student, info in seen.items():
            assert Path(info["python"]).parent == Path(python).parent and info["student"] == "1", (
                info
            )
        assert seen[SOLVED]["gpu"] == FAKE_SLICE and seen[SOLVED]["note"] == ""
        assert seen[UNSOLVED]["gpu"] == "" and seen[UNSOLVED]["note"].startswith(
            f"no GPU for {UNSOLVED} ({env['OFFLOADLAB_GPU_SLICES']} has no entry for them)"
        ), seen[UNSOLVED]
        assert f"no GPU for {UNSOLVED}" in hub_log.read_text()
        assert all(info["threads"] == THREADS for info in seen.values()), seen
        # staff see the class but are no hub admins; students see neither; the culler runs
        assert not hub.call(f"/hub/api/users/{INSTRUCTOR}")["admin"]
        assert hub.status("/hub/api/users", hub.user_tokens[INSTRUCTOR]) == 200
        assert hub.status("/hub/api/users", hub.user_tokens[UNSOLVED]) == 403
        assert any(
            "jupyterhub_idle_culler" in " ".join(child.cmdline())
            for child in psutil.Process(hub_process.pid).children(recursive=True)
        ), "the idle culler is not running"
        with stages("a dishonest student"):
            tried = try_to_cheat(hub, UNSOLVED, course, exchange, state)
        assert set(tried.values()) == {"refused"}, tried
        with stages("a student takes more memory than her server's share"):
            hogged = take_too_much_memory(hub, UNSOLVED)
        # the OOM killer ends the process that allocated; her kernel and server live on
        assert hogged["returncode"] == -9, hogged
        assert f"offloadlab-{UNSOLVED}" in hogged["groups"], hogged
        assert "runs with no memory or CPU cap" not in hub_log.read_text()
        # the servers' log: the shared settings were found
        assert "No nbgrader_config.py" not in hub_log.read_text()
        for assignment in LABS:
            with stages(f"instructor: collect and autograde {assignment}"):
                instructor(blocks[5][1], env, assignment)
            grader = INSTRUCTOR if assignment == "lab01" else TA
            with stages(f"{grader}: the reflections of {assignment}, in the Formgrader"):
                given = grade_by_hand(hub, grader, {SOLVED: True, UNSOLVED: False}, assignment)
            assert given == {SOLVED: by_hand_points(assignment), UNSOLVED: 0}, given
            with stages(f"instructor: feedback and grades of {assignment}"):
                instructor(blocks[6][1], env, assignment)
            with stages(f"students fetch feedback of {assignment}"):
                for student in (SOLVED, UNSOLVED):
                    hub.user(
                        student,
                        "/assignments/fetch_feedback",
                        {"course_id": COURSE_ID, "assignment_id": assignment},
                        method="POST",
                        form=True,
                    )
            grades = grades_csv(GRADER_HOME / COURSE_ID / "grades.csv", assignment)
            automatic = automatic_points(assignment)
            assert grades[SOLVED] == automatic + given[SOLVED], (assignment, grades)
            assert grades[UNSOLVED] == 0, (assignment, grades)
            assert grades[ABSENT] == 0, grades  # on the roster, though they never submitted
            for student in (SOLVED, UNSOLVED):
                check_feedback(student, assignment, grades[student])
        logged = (GRADER_HOME / COURSE_ID / "nbgrader.log").read_text(encoding="utf-8")
        assert "[AutogradeApp | INFO]" in logged and "[GenerateFeedbackApp | INFO]" in logged
        # a server the hub stops (as the idle culler does) leaves no control group behind
        hogged_in = [Path(line.split(":", 2)[2]).name for line in hogged["groups"].splitlines()]
        assert f"offloadlab-{UNSOLVED}" in hogged_in
        try:
            hub.call(f"/hub/api/users/{UNSOLVED}/server", method="DELETE")
        except urllib.error.HTTPError as error:
            assert error.code in (202, 204), error.code
        deadline = time.monotonic() + 60
        while hub.call(f"/hub/api/users/{UNSOLVED}").get("servers") and time.monotonic() < deadline:
            time.sleep(0.5)
        left = list(Path("/sys/fs/cgroup").rglob(f"offloadlab-{UNSOLVED}"))
        assert not left, left
    finally:
        if hub_process is not None:
            end_with_its_children(hub_process)
        for user in (SOLVED, UNSOLVED, INSTRUCTOR, GRADER):
            # the servers the hub left behind
            subprocess.run(["pkill", "-u", user], capture_output=True)
        for user in (SOLVED, UNSOLVED, ABSENT, INSTRUCTOR, TA, GRADER):
            subprocess.run(["userdel", "-r", user], capture_output=True)
        # the control groups of servers the hub did not stop itself
        remove(sorted(Path("/sys/fs/cgroup").rglob(f"offloadlab-olab{RUN}-*")))
        if not kept:
            shutil.rmtree(base, ignore_errors=True)
        print(json.dumps(stages.seconds))


def check_feedback(student: str, assignment: str, score: float) -> None:
    """The feedback page the student fetched: their score, the lab's code, no hidden test, and
    for the one who rebound a check, the grader's note that it did not run that cell."""
    pages = list(Path(f"/home/{student}/{COURSE_ID}/{assignment}/feedback").glob("*/*.html"))
    assert pages, f"{student} received no feedback for {assignment}"
    page = pages[0].read_text(encoding="utf-8")
    assert re.search(rf"Score: {score:g}(\.0)? / ", page), pages[0]
    shown = page_text(page)
    assert "HIDDEN TESTS" not in shown and hidden_line(assignment) not in shown, pages[0]
    assert "import" in shown  # the page's code is there: only the hidden tests are not
    screened = "this answer cell was not run: it changes the attribute answer"
    assert (screened in shown) == (student == UNSOLVED), pages[0]


# What a student's kernel can reach, tried from one: each must answer "refused".
CHEAT = """
import json, os
tried = {}
for what, path in json.loads(%r).items():
    try:
        if what == "rename the course's exchange folder":
            os.rename(path, path + "-mine")
        elif what.startswith("list"):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        tried[what] = "done"
    except PermissionError:
        tried[what] = "refused"
    except FileNotFoundError:
        tried[what] = "missing"
print(json.dumps(tried))
"""


HOG = """
import json, subprocess, sys
hog = subprocess.run([sys.executable, "-c", "b = bytearray(%d)"], capture_output=True)
print(json.dumps({"returncode": hog.returncode, "groups": open("/proc/self/cgroup").read()}))
"""


def take_too_much_memory(hub: Hub, student: str) -> dict:
    """From ``student``'s kernel, start a process that fills one and a half times the server's
    memory cap: its exit status, and the kernel's control groups."""
    path = f"{COURSE_ID}/lab01/{LAB.stem}.ipynb"
    (result,) = run_cells(hub, student, path, [HOG % (3 * MEMORY_LIMIT // 2)])
    assert result["status"] == "ok", result
    return json.loads(result["outputs"][0]["text"])


def try_to_cheat(hub: Hub, student: str, course: Path, exchange: Path, state: Path) -> dict:
    """From ``student``'s kernel, read what the recipe keeps from students and take over the
    exchange: {attempt: "refused", "done" or "missing"}."""
    other = SOLVED if student != SOLVED else UNSOLVED
    targets = {
        "read a lab's worked answers": course / "labs" / LAB.name,
        "read the checkout's history": course / ".git" / "HEAD",
        "list the checkout": course,
        "read the course's source": GRADER_HOME
        / COURSE_ID
        / "source"
        / "lab01"
        / f"{LAB.stem}.ipynb",
        "read the gradebook": GRADER_HOME / COURSE_ID / "gradebook.db",
        "read another student's lab": Path(f"/home/{other}/{COURSE_ID}/lab01")
        / f"{LAB.stem}.ipynb",
        "read the hub's database": state / "jupyterhub.sqlite",
        "rename the course's exchange folder": exchange / COURSE_ID,
    }
    missing = [str(path) for path in targets.values() if not path.exists()]
    assert not missing, f"nothing to try on: {missing}"
    path = f"{COURSE_ID}/lab01/{LAB.stem}.ipynb"
    code = CHEAT % json.dumps({what: str(target) for what, target in targets.items()})
    (result,) = run_cells(hub, student, path, [code])
    assert result["status"] == "ok", result
    return json.loads(result["outputs"][0]["text"])


def grade_by_hand(
    hub: Hub, staff: str, full_marks: dict[str, bool], assignment: str
) -> dict[str, float]:
    """``staff`` grades the reflections through the grading server's Formgrader: full marks or
    none for each student. Points given, per student."""
    given = {}
    notebooks = hub.grading(
        staff, f"/formgrader/api/submitted_notebooks/{assignment}/{LABS[assignment].stem}"
    )
    assert sorted(n["student"] for n in notebooks) == sorted(full_marks), notebooks
    for notebook in notebooks:
        student = notebook["student"]
        given[student] = 0.0
        grades = hub.grading(staff, f"/formgrader/api/grades?submission_id={notebook['id']}")
        for grade in grades:
            if grade["needs_manual_grade"]:
                score = grade["max_score"] if full_marks[student] else 0.0
                hub.grading(
                    staff,
                    f"/formgrader/api/grade/{grade['id']}",
                    {"manual_score": score},
                    method="PUT",
                )
                given[student] += score
    return given


def page_text(html_page: str) -> str:
    """What a feedback page shows, without its markup (code is split into highlighted tokens)."""
    import html

    return html.unescape(re.sub(r"<[^>]*>", "", html_page))


def hidden_line(assignment: str) -> str:
    """The first line of code in the lab's hidden tests, as the instructor's source has it."""
    for cell in source_notebook(LABS[assignment]).cells:
        if "### BEGIN HIDDEN TESTS" in cell.source:
            body = cell.source.split("### BEGIN HIDDEN TESTS", 1)[1]
            lines = body.split("### END HIDDEN TESTS", 1)[0].splitlines()
            return next(line.strip() for line in lines if line.strip())
    raise AssertionError(f"{assignment} has no hidden tests")


def by_hand_points(assignment: str) -> float:
    """The reflections' points: the markdown cells graded by hand."""
    return sum(
        c.metadata["nbgrader"]["points"]
        for c in source_notebook(LABS[assignment]).cells
        if c.metadata.get("nbgrader", {}).get("grade") and c.cell_type == "markdown"
    )


def instructor(commands: str, env: dict, lab: str) -> None:
    """A staff block, run as the grading account (as in the grading server's terminal), for the
    lab ``lab`` (the page's LAB)."""
    home = str(GRADER_HOME)
    keep = {k: env[k] for k in ("COURSE", "OFFLOADLAB_EXCHANGE")} | {"LAB": lab}
    result = subprocess.run(
        [
            "runuser",
            "-u",
            GRADER,
            "--",
            "env",
            f"HOME={home}",
            f"USER={GRADER}",
            "PATH=/usr/local/bin:/usr/bin:/bin",
            *(f"{k}={v}" for k, v in keep.items()),
            "bash",
            "-euo",
            "pipefail",
            "-c",
            runnable(commands),
        ],
        cwd="/",
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, (
        f"the staff's commands failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    errors = [line for line in result.stderr.splitlines() if "| ERROR]" in line]
    assert not errors, "\n".join(errors)


def disabled_extensions(lab_page: str) -> list[str]:
    config = json.loads(
        re.search(
            r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
            lab_page,
            re.DOTALL,
        ).group(1)
    )
    return config.get("disabledExtensions", [])


def grades_csv(path: Path, assignment: str) -> dict[str, float]:
    import csv

    with path.open(encoding="utf-8") as f:
        return {
            row["student_id"]: float(row["score"])
            for row in csv.DictReader(f)
            if row["assignment"] == assignment
        }


def automatic_points(assignment: str) -> float:
    """The points nbgrader gives by itself: every graded cell but the reflections graded by hand."""
    return sum(
        c.metadata["nbgrader"]["points"]
        for c in source_notebook(LABS[assignment]).cells
        if c.metadata.get("nbgrader", {}).get("grade") and c.cell_type == "code"
    )
