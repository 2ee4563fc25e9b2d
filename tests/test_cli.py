"""`python -m miles_ext_kernels`: every subcommand answers --help; doctor and demo run on this machine."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*argv, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "miles_ext_kernels", *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sub", [[], ["doctor"], ["prebuild"], ["bench"], ["demo"]])
def test_help(sub):
    out = cli(*sub, "--help")
    assert out.returncode == 0 and "usage" in out.stdout


def test_doctor():
    out = cli("doctor")
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "triton" in out.stdout and "workspace pool bound" in out.stdout


def test_prebuild_bad_param():
    out = cli("prebuild", "nosuchop", "--param", "x")
    assert out.returncode != 0 and "key=value" in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU machine behaviour")
def test_gpu_commands_explain_themselves_on_cpu():
    out = cli("prebuild", "gqa")
    assert out.returncode == 2 and "CUDA GPU" in out.stderr and "Traceback" not in out.stderr
    out = cli("bench", "gqa")
    assert out.returncode == 2 and "CUDA GPU" in out.stderr and "Traceback" not in out.stderr


def test_bench_unknown_op():
    out = cli("bench", "nosuchop")
    assert out.returncode != 0 and "nosuchop" in out.stderr


def test_demo_runs_every_op():
    """The main job: every registered op against its reference, a table, exit 0 only when all pass."""
    out = cli("demo")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    from miles_ext_kernels import cake

    for spec in cake.OPS:
        assert spec.name in out.stdout
