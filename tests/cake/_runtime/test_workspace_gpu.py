"""The workspace pool on a GPU: real CUDA streams as keys, and graph capture allocating outside the pool."""
import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake._runtime import workspace

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def clean():
    mek.configure(workspace_pool_bytes=1 << 24)
    workspace.release()
    workspace.reset_stats()
    yield
    workspace.release()


def test_cuda_streams_get_their_own_buffers():
    side = torch.cuda.Stream()
    a = workspace.take(("t", "s"), 4096, device="cuda")
    with torch.cuda.stream(side):
        b = workspace.take(("t", "s"), 4096, device="cuda")
    c = workspace.take(("t", "s"), 4096, device="cuda", stream=side)
    assert a.data_ptr() != b.data_ptr() and b.data_ptr() == c.data_ptr()
    assert workspace.stats()["buffers"] == 2


def test_graph_capture_bypasses_the_pool():
    workspace.take(("t", "g"), 4096, device="cuda")
    held = workspace.stats()["held_bytes"]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            buf = workspace.take(("t", "g"), 4096, device="cuda")
            buf.fill_(7)
    g.replay()
    torch.cuda.synchronize()
    st = workspace.stats()
    assert st["bypass"] == 1 and st["held_bytes"] == held
    assert int(buf[0]) == 7
