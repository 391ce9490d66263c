"""offloadlab.trace: what a timeline leaves in a notebook."""

import subprocess
import sys


def test_the_profilers_own_lines_stay_out_of_a_notebook():
    """torch.profiler prints "USDT:<date> <pid>:<tid> …] profiler_start" to native stderr at each
    start and stop; chapter 1 showed them, the build machine's date and process id included.
    Inside trace.profiler_lines_silenced() they are not printed; Python's stderr still is."""
    code = (
        "import sys, torch\n"
        "from torch.profiler import ProfilerActivity, profile\n"
        "from offloadlab import trace\n"
        "import contextlib\n"
        "quiet = trace.profiler_lines_silenced() if sys.argv[1] == 'quiet' else None\n"
        "with quiet or contextlib.nullcontext(), profile(activities=[ProfilerActivity.CPU]):\n"
        "    torch.ones(3) * 2\n"
        "print('said after', file=sys.stderr)\n"
    )
    said = {
        how: subprocess.run(
            [sys.executable, "-c", code, how], capture_output=True, text=True, check=True
        ).stderr
        for how in ("loud", "quiet")
    }
    assert "profiler_start" in said["loud"]  # what torch prints, so the test can fail
    assert "profiler_st" not in said["quiet"] and said["quiet"].strip() == "said after"
