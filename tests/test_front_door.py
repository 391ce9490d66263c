"""The package's front door: its public API is one import away, and the README shows it first."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_public_api_is_one_import_away_and_importing_loads_no_torch():
    """The finding (issue 36): offloadlab exported nothing but __version__ and LAYERS. The names
    resolve on first use, so `import offloadlab` stays light (the site's calculators import it in
    the browser, where there is no torch)."""
    code = (
        "import sys, offloadlab as o\n"
        "assert 'torch' not in sys.modules, 'import offloadlab loaded torch'\n"
        "names = [n for n in o.__all__ if n not in ('__version__', 'LAYERS')]\n"
        "assert all(getattr(o, n) is not None for n in names) and 'CPUOffloadAdam' in dir(o)\n"
        "o.CPUOffloadAdam, o.Prefetcher, o.StreamedModel\n"
        "try:\n    o.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "has no attribute 'no_such_name'" in done.stdout


def test_the_readme_opens_with_the_python_api_and_its_example_trains():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (.+)$", readme, flags=re.M)
    assert sections[0] == "Use it from Python"
    example = re.search(r"## Use it from Python\n\n```python\n(.*?)```", readme, flags=re.S)[1]
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", example],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
