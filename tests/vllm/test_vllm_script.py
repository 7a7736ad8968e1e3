"""A user's script that loads ``backend="vllm"`` without an ``if __name__ == "__main__":`` guard
runs: the engine core stays in the script's process, so nothing re-imports the script."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SCRIPT = textwrap.dedent("""
    from ktm.core.prompt import Segment
    from ktm.model import KTMModel

    prompt = [Segment("def add(a, b):\\n    return a + b\\n" * 8),
              Segment("\\nExplain:", compress=False)]
    on_vllm = KTMModel.load("smollm2-135m-k4-seq", backend="vllm").generate(
        prompt, max_new_tokens=8)
    on_torch = KTMModel.load("smollm2-135m-k4-seq").generate(prompt, max_new_tokens=8)
    print("SAME" if on_vllm == on_torch else f"DIFFERENT {on_vllm!r} {on_torch!r}")
""")


def test_a_script_without_a_main_guard_runs_on_vllm(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "SAME"
