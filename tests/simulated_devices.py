"""Running a test script on N simulated CPU devices.

pytest workers import JAX with one CPU device before any test runs, and the
device count is fixed when the CPU client starts, so a multi-device check runs
its script in a subprocess with `--xla_force_host_platform_device_count=N` added
to XLA_FLAGS (the others, and the run's compilation cache, carry over from
tests/conftest.py). The script prints one line `RESULT <json>` with what the
test asserts on.
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(num_devices: int) -> dict:
  """This process's environment for a subprocess on `num_devices` CPU devices:
  XLA_FLAGS keeps its flags (the compile level tests/conftest.py sets) with the
  device count replaced."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                 os.environ.get("XLA_FLAGS", ""))
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      f"{flags} --xla_force_host_platform_device_count={num_devices}").strip())


def run(script: str, *args: str, num_devices: int = 8, timeout: float = 600) -> dict:
  """Runs `script` (Python source) from the repository root on `num_devices`
  CPU devices with `args` as sys.argv[1:]; returns its RESULT line's JSON."""
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env(num_devices), cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-5000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert lines, f"the script printed no RESULT line:\n{proc.stdout[-3000:]}"
  return json.loads(lines[-1][len("RESULT"):])
