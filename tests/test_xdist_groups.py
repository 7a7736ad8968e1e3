"""The README's test command runs one pytest-xdist worker per core with ``--dist loadgroup``
(pyproject.toml), and the tests of one ``xdist_group`` (those sharing a vLLM engine) must reach
one worker: spread, each worker would start the engine, a minute each."""

import subprocess
import sys


def test_the_tests_of_one_group_run_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\n"
        "pytestmark = pytest.mark.xdist_group('one')\n\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_worker(i):\n"
        "    print('worker', os.environ['PYTEST_XDIST_WORKER'])\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
                          "--dist", "loadgroup", "-rA", "-q", str(tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    workers = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("worker ")}
    assert out.stdout.count("PASSED") == 6 and len(workers) == 1, out.stdout[-2000:]
