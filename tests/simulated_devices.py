"""Running a test script on N simulated CPU devices.

pytest workers import JAX with one CPU device before any test runs, and the
device count is fixed when the CPU client starts, so a multi-device check runs
its script in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=N`.
The script prints one line `RESULT <json>` with what the test asserts on.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args: str, num_devices: int = 8, timeout: float = 600) -> dict:
  """Runs `script` (Python source) from the repository root on `num_devices`
  CPU devices with `args` as sys.argv[1:]; returns its RESULT line's JSON."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}")
  proc = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-5000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert lines, f"the script printed no RESULT line:\n{proc.stdout[-3000:]}"
  return json.loads(lines[-1][len("RESULT"):])
