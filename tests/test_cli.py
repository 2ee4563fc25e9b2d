"""`python -m miles_ext_kernels`: every subcommand answers --help; doctor and demo run on this machine."""
import os
import subprocess
import sys

import pytest

from tests._paths import ROOT


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


def test_demo_unknown_op_exits_2_listing_the_ops():
    """exit 0 means every op passed: an op name that matches nothing must not pass as "nothing failed"."""
    from miles_ext_kernels import cake

    for argv in (["demo", "nosuch"], ["demo", "rmsnorm", "nosuch"]):
        out = cli(*argv)
        assert out.returncode == 2 and "'nosuch'" in out.stderr and "Traceback" not in out.stderr
        assert all(s.name in out.stderr for s in cake.OPS)


def test_help_lists_the_ops_and_their_params():
    from miles_ext_kernels import cake

    text = cli("prebuild", "--help").stdout
    for spec in cake.OPS:
        assert spec.name in text
        for p in spec.prebuild_params:
            assert f"--param {p}=" in text
    text = cli("bench", "--help").stdout
    assert all(s.name in text for s in cake.OPS) and "norms" in text
    assert all(s.name in cli("demo", "--help").stdout for s in cake.OPS)


def test_bench_takes_a_script_name():
    """bench/norms.py serves rmsnorm and gated_rmsnorm: `bench norms` is a known target (on CPU it then says why it
    cannot run, as for an op name)."""
    out = cli("bench", "norms")
    assert "unknown" not in out.stderr and "Traceback" not in out.stderr
    if not __import__("torch").cuda.is_available():
        assert out.returncode == 2 and "CUDA GPU" in out.stderr


def test_errors_are_plain_text():
    for argv in (["prebuild", "nosuch"], ["bench", "nosuch"]):
        out = cli(*argv)
        assert out.returncode == 2 and "unknown" in out.stderr and "'nosuch'" in out.stderr
        assert '"' not in out.stderr and "Traceback" not in out.stderr  # no KeyError quoting around the message
