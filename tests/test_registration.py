"""The backend is visible by name in a fresh process, with or without ``import graphzero``, and
TORCH_LOGS knows graphzero's logger."""
from __future__ import annotations

import subprocess
import sys


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=False)


def test_entry_point_makes_backend_visible_without_import():
    out = run_python("import torch\n"
                     "from torch._dynamo import lookup_backend\n"
                     "fn = lookup_backend('graphzero')\n"
                     "print(fn.__module__, fn.__name__)\n"
                     "import graphzero\n"                      # importing afterwards must not re-register
                     "assert lookup_backend('graphzero') is fn\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "graphzero.compiler graphzero_backend"


def test_compile_without_engines_is_plain_autograd():
    # No engine owns anything: graphzero compiles the graph unchanged and .grad is ordinary.
    out = run_python("import torch\n"
                     "m = torch.nn.Linear(3, 2)\n"
                     "f = torch.compile(lambda x: m(x).square().sum(), backend='graphzero', options={'inner': 'eager'})\n"
                     "x = torch.randn(4, 3)\n"
                     "f(x).backward()\n"
                     "g = m.weight.grad.clone(); m.zero_grad()\n"
                     "m(x).square().sum().backward()\n"
                     "torch.testing.assert_close(g, m.weight.grad)\n"
                     "print('ok')\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_torch_logs_knows_graphzero():
    out = run_python("import logging, graphzero\n"
                     "print(logging.getLogger('graphzero').getEffectiveLevel())\n", TORCH_LOGS="graphzero")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(__import__("logging").INFO)
