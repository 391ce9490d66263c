"""JupyterHub for an offloadlab course: local Unix accounts, no Docker (book/course.md, "The hub").

Every single-user server runs from the kit's own environment (``$OFFLOADLAB_COURSE/.venv``, made
by ``make course``), so ``python3`` in a student's notebook is the Python that has offloadlab,
nbgrader and JupyterLab. Who is who comes from two Unix groups:

- ``offload-students``: student mode (``OFFLOADLAB_STUDENT=1``: the answer checks never show an
  expected value) and nbgrader's student tools only (Assignments, Validate);
- ``offload-staff``: instructors and TAs, no student mode, the right to list the class and start
  or stop its servers (not hub admins: nobody is), and access to the course's grading server.
  Read when the hub starts: restart it after adding staff.

The grading server is nbgrader's shared grader (its JupyterHub guide, "multiple graders"): a
hub service named after the course, at ``/services/offload-course/``, running as one Unix
account that holds the course folder, the gradebook and nbgrader's instructor tools. Staff open
it; their own servers, like students', carry no instructor tool that could find no course.

A GPU (or MIG slice) per user comes from an optional JSON table, user name -> device UUID as
``nvidia-smi -L`` prints it. A user without an entry gets a server with no GPU at all (the labs
then run on the emulated link and say so), and the hub's log says why; nobody gets an error.

Settings, read from the environment the hub is started with (all optional):

- ``OFFLOADLAB_COURSE``: the kit's folder (default ``/opt/offloadlab``);
- ``OFFLOADLAB_GPU_SLICES``: the table's path (default
  ``$OFFLOADLAB_COURSE/course/gpu-slices.json``);
- ``OFFLOADLAB_HUB_URL``: where the hub listens (default ``http://127.0.0.1:8000``; put your HTTPS
  reverse proxy in front of it);
- ``OFFLOADLAB_PROXY_API_URL``: where the hub talks to its proxy (default
  ``http://127.0.0.1:8001``; a second hub on the same host needs another port);
- ``OFFLOADLAB_EXCHANGE``: nbgrader's exchange, when not ``/srv/nbgrader/exchange``;
- ``OFFLOADLAB_GRADER``: the grading account (default ``grader-offload-course``); without that
  account there is no grading server, and the hub's log says so;
- ``OFFLOADLAB_GRADER_URL``: where the grading server listens (default ``http://127.0.0.1:9999``);
- ``OFFLOADLAB_THREADS``: CPU threads each server's kernels may use (``OMP_NUM_THREADS`` and
  torch's pool; default an eighth of the server's cores, at least one): torch otherwise takes
  every core in every kernel, and a class of them starves each other's measurements;
- ``OFFLOADLAB_MEMORY_LIMIT``: the memory each user's server, its kernels and what they start may
  hold together (default ``4 GiB``); past it the kernel's OOM killer ends the process that
  allocated, not a classmate's. With ``OFFLOADLAB_THREADS`` as the same group's CPU cap, it is
  enforced through a control group per user (offloadlab_course.limits; on a systemd host the
  hub's unit needs ``Delegate=yes``); where none can be made, the hub's log says so;
- ``OFFLOADLAB_IDLE_TIMEOUT``: seconds after which a server nobody uses is stopped (default
  3600), freeing its memory; its files stay;
- ``OFFLOADLAB_HUB_TOKEN``: a token for scripting the class through the hub's REST API (starting
  every server before a lab session, say); without it there is no such service.

The spawner leaves ``ulimit -l`` (RLIMIT_MEMLOCK) as it is: CUDA's pinned memory is not charged
to it (NVIDIA's driver pins pages itself and never reads that limit; book/course.md, "A hub
that measures something real", gives the sources), so raising it would change nothing.
"""

import grp
import json
import logging
import os
import pwd
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner

from offloadlab.units import parse_size
from offloadlab_course.limits import UserLimits, join, remove

c = get_config()  # noqa: F821 (JupyterHub provides it)

COURSE = Path(os.environ.get("OFFLOADLAB_COURSE", "/opt/offloadlab"))
ENVIRONMENT = COURSE / ".venv"
STUDENTS, STAFF = "offload-students", "offload-staff"
COURSE_ID = "offload-course"  # course/nbgrader_config.py's; the grading service takes its name
GRADER = os.environ.get("OFFLOADLAB_GRADER", "grader-offload-course")
GRADER_URL = os.environ.get("OFFLOADLAB_GRADER_URL", "http://127.0.0.1:9999")
LOG = logging.getLogger("JupyterHub")  # the hub's own log
SLICES_FILE = Path(os.environ.get("OFFLOADLAB_GPU_SLICES", COURSE / "course" / "gpu-slices.json"))
THREADS = int(os.environ.get("OFFLOADLAB_THREADS", max(1, (os.cpu_count() or 1) // 8)))
IDLE_SECONDS = int(os.environ.get("OFFLOADLAB_IDLE_TIMEOUT", 3600))
LIMITS = UserLimits(
    parse_size(os.environ.get("OFFLOADLAB_MEMORY_LIMIT", "4 GiB"), "OFFLOADLAB_MEMORY_LIMIT"),
    cpus=THREADS,
)


def members(group: str) -> set[str]:
    """The user names in a Unix group (none if the group does not exist)."""
    try:
        return set(grp.getgrnam(group).gr_mem)
    except KeyError:
        return set()


def gpu_slices() -> tuple[dict[str, str], str]:
    """(user -> GPU or MIG UUID, why the table gave nothing); read at every spawn, so an edit
    needs no restart. A table that does not parse gives every server no GPU, never an error page."""
    if not SLICES_FILE.exists():
        return {}, f"there is no GPU slice table at {SLICES_FILE}"
    try:
        table = json.loads(SLICES_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return {}, f"the GPU slice table {SLICES_FILE} could not be read ({error})"
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        return (
            {},
            f"the GPU slice table {SLICES_FILE} is not an object of user names to device UUIDs",
        )
    return table, f"{SLICES_FILE} has no entry for them"


def server_environment(name: str, log) -> dict[str, str]:
    """What every server of ``name`` runs with: the kit's Python, the thread cap, the exchange,
    student mode for students only, and a GPU slice or none (the log says why none)."""
    environment = {
        "PATH": f"{ENVIRONMENT / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "OMP_NUM_THREADS": str(THREADS),
        "MKL_NUM_THREADS": str(THREADS),
        "OFFLOADLAB_STUDENT": "0" if name in members(STAFF) else "1",
    }
    # an exchange elsewhere than course/nbgrader_config.py's default
    if "OFFLOADLAB_EXCHANGE" in os.environ:
        environment["OFFLOADLAB_EXCHANGE"] = os.environ["OFFLOADLAB_EXCHANGE"]
    slices, why_none = gpu_slices()
    device = slices.get(name)
    if device:
        environment["CUDA_VISIBLE_DEVICES"] = device
    else:
        environment["CUDA_VISIBLE_DEVICES"] = ""
        environment["OFFLOADLAB_GPU_NOTE"] = (
            f"no GPU for {name} ({why_none}): this server has no GPU, "
            "and the labs run on the emulated link"
        )
        log.warning("offloadlab: %s", environment["OFFLOADLAB_GPU_NOTE"])
    return environment


def set_up_server(spawner):
    """A user's own server: its environment, and nbgrader's instructor tools off (they live in
    the grading server): the Lab side through course/students/labconfig, the server side here
    (the environment's own settings, which enable them, would override a settings file)."""
    spawner.environment.update(server_environment(spawner.user.name, spawner.log))
    spawner.environment["JUPYTER_CONFIG_PATH"] = str(COURSE / "course" / "students")
    off = {
        "nbgrader.server_extensions.formgrader": False,
        "nbgrader.server_extensions.course_list": False,
    }
    # (traitlets reads a Python literal)
    spawner.args = [*spawner.args, f"--ServerApp.jpserver_extensions={off!r}"]


c.JupyterHub.bind_url = os.environ.get("OFFLOADLAB_HUB_URL", "http://127.0.0.1:8000")
# Named, not left to the proxy's default (8001), which a second hub on the host would also take.
c.ConfigurableHTTPProxy.api_url = os.environ.get(
    "OFFLOADLAB_PROXY_API_URL", "http://127.0.0.1:8001"
)


class LimitedSpawner(LocalProcessSpawner):
    """The local spawner, each server started inside its user's control group (LIMITS)."""

    def make_preexec_fn(self, name):
        become_the_user = super().make_preexec_fn(name)
        groups, why_none = LIMITS.prepare(name)
        if why_none:
            self.log.warning(
                "offloadlab: %s: %s's server runs with no memory or CPU cap", why_none, name
            )

        def preexec():  # in the server's process, still root
            join(groups)
            become_the_user()

        return preexec

    async def stop(self, now=False):
        await super().stop(now=now)
        remove(LIMITS.groups_of(self.user.name))


c.JupyterHub.spawner_class = LimitedSpawner
c.Spawner.mem_limit = LIMITS.memory_bytes  # (shown to the server as MEM_LIMIT; enforced above)
c.Spawner.cpu_limit = THREADS
c.Spawner.cmd = [str(ENVIRONMENT / "bin" / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.pre_spawn_hook = set_up_server
c.Spawner.http_timeout = 120  # a first start imports torch, which takes a while on a cold disk
c.PAMAuthenticator.allowed_groups = {STUDENTS, STAFF}

# Staff see the class and start or stop its servers; the culler stops servers left idle.
c.JupyterHub.load_roles = [
    {
        "name": "course-staff",
        "users": sorted(members(STAFF)),
        "scopes": ["self", "list:users", "read:users:activity", "admin:servers"],
    },
    {
        "name": "idle-culler",
        "services": ["idle-culler"],
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    },
]
c.JupyterHub.services = [
    {
        "name": "idle-culler",
        "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={IDLE_SECONDS}"],
    },
]
# The grading server: nbgrader's instructor tools over the grading account's course folder.
try:
    grader_home = pwd.getpwnam(GRADER).pw_dir
except KeyError:
    LOG.warning("offloadlab: no grading server: no account %s (book/course.md, step 3)", GRADER)
else:
    c.JupyterHub.services.append(
        {
            "name": COURSE_ID,
            "url": GRADER_URL,
            "command": [str(ENVIRONMENT / "bin" / "jupyterhub-singleuser")],
            "user": GRADER,
            "cwd": grader_home,
            "environment": {
                **server_environment(GRADER, LOG),
                "JUPYTERHUB_DEFAULT_URL": "/lab",
            },
        }
    )
    c.JupyterHub.load_roles[0]["scopes"] += [
        f"access:services!service={COURSE_ID}",
        f"read:services!service={COURSE_ID}",
        "list:services",
    ]
if os.environ.get("OFFLOADLAB_HUB_TOKEN"):
    c.JupyterHub.services.append(
        {"name": "course-admin", "api_token": os.environ["OFFLOADLAB_HUB_TOKEN"]}
    )
    c.JupyterHub.load_roles.append(
        {
            "name": "course-admin",
            "services": ["course-admin"],
            "scopes": ["admin:users", "admin:servers", "tokens", "access:servers", "list:users"],
        }
    )
