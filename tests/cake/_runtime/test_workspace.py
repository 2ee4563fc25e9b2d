"""The workspace pool, on CPU tensors with simulated streams (any hashable key stands for a stream)."""
import threading

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake._runtime import workspace

ROLE = ("synthetic", "scratch")


@pytest.fixture(autouse=True)
def clean():
    workspace.release()
    workspace.reset_stats()
    yield
    workspace.release()


def test_bound_zero_keeps_nothing():
    a = workspace.take(ROLE, 1000, device="cpu")
    b = workspace.take(ROLE, 1000, device="cpu")
    assert a.dtype == torch.uint8 and a.numel() == 1000
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()  # two allocations, nothing shared
    s = workspace.stats()
    assert s["held_bytes"] == 0 and s["buffers"] == 0 and s["hits"] == 0
    assert mek.release() == 0


def test_take_tensor_typed_from_the_pool_or_plain():
    a = workspace.take_tensor(ROLE, (3, 5), torch.float32, device="cpu")  # bound 0: a plain allocation
    assert (a.shape, a.dtype) == ((3, 5), torch.float32) and workspace.stats()["misses"] == 0
    mek.configure(workspace_pool_bytes=10_000)
    try:
        b = workspace.take_tensor(ROLE, (3, 5), torch.float32, device="cpu")
        c = workspace.take_tensor(ROLE, (2, 4), torch.bfloat16, device="cpu")  # smaller: the same buffer
        assert (c.shape, c.dtype) == ((2, 4), torch.bfloat16) and c.data_ptr() == b.data_ptr()
        s = workspace.stats()
        assert (s["hits"], s["misses"], s["held_bytes"]) == (1, 1, 60)
    finally:
        mek.configure()


def test_hit_miss_grow():
    mek.configure(workspace_pool_bytes=10_000)
    a = workspace.take(ROLE, 1000, device="cpu")
    b = workspace.take(ROLE, 800, device="cpu")  # smaller: same buffer
    assert b.data_ptr() == a.data_ptr() and b.numel() == 800
    c = workspace.take(ROLE, 3000, device="cpu")  # larger: grown
    assert c.numel() == 3000
    s = workspace.stats()
    assert (s["hits"], s["misses"], s["held_bytes"], s["buffers"]) == (1, 2, 3000, 1)


def test_roles_and_streams_are_separate_buffers():
    mek.configure(workspace_pool_bytes=10_000)
    a = workspace.take(ROLE, 100, device="cpu", stream="s0")
    b = workspace.take(ROLE, 100, device="cpu", stream="s1")
    c = workspace.take(("synthetic", "other"), 100, device="cpu", stream="s0")
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert workspace.stats()["buffers"] == 3


def test_lru_eviction_under_bound():
    mek.configure(workspace_pool_bytes=3000)
    for r in ("a", "b", "c"):
        workspace.take(r, 1000, device="cpu")
    workspace.take("a", 1000, device="cpu")  # a is now most recent
    workspace.take("d", 1000, device="cpu")  # evicts b, the least recently used
    s = workspace.stats()
    assert s["evictions"] == 1 and s["held_bytes"] == 3000
    hits = s["hits"]
    workspace.take("a", 1000, device="cpu")
    workspace.take("c", 1000, device="cpu")
    assert workspace.stats()["hits"] == hits + 2  # a and c survived
    workspace.take("b", 1000, device="cpu")
    assert workspace.stats()["misses"] == 5  # b was gone


def test_lowered_bound_evicts_lru_first():
    mek.configure(workspace_pool_bytes=4000)
    for r in ("a", "b", "c", "d"):
        workspace.take(r, 1000, device="cpu")
    workspace.take("a", 1000, device="cpu")
    mek.configure(workspace_pool_bytes=2000)  # keeps the two most recent: d, a
    s = workspace.stats()
    assert s["held_bytes"] == 2000 and s["evictions"] == 2
    h = s["hits"]
    workspace.take("a", 1000, device="cpu")
    workspace.take("d", 1000, device="cpu")
    assert workspace.stats()["hits"] == h + 2


def test_eviction_stays_on_its_device():
    """The bound is per device: filling another device's pool never evicts this one's buffers."""
    mek.configure(workspace_pool_bytes=2000)
    workspace.take("keep", 1500, device="cpu")
    for r in ("m1", "m2", "m3"):
        workspace.take(r, 1000, device="meta")  # meta: a second device that allocates nothing
    s = workspace.stats()
    assert s["held_bytes_by_device"] == {"cpu": 1500, "meta": 2000} and s["evictions"] == 1
    h = s["hits"]
    workspace.take("keep", 1500, device="cpu")
    assert workspace.stats()["hits"] == h + 1


def test_request_over_bound_is_served_unpooled():
    mek.configure(workspace_pool_bytes=1000)
    t = workspace.take(ROLE, 5000, device="cpu")
    assert t.numel() == 5000 and workspace.stats()["held_bytes"] == 0


def test_release_returns_exactly_the_bytes_held():
    mek.configure(workspace_pool_bytes=1 << 20)
    sizes = [100, 2000, 333, 4096]
    for i, n in enumerate(sizes):
        workspace.take(("r", i), n, device="cpu")
    assert workspace.stats()["held_bytes"] == sum(sizes)
    assert mek.release() == sum(sizes)
    assert workspace.stats()["held_bytes"] == 0 and mek.release() == 0


def test_threads_and_streams_consistent():
    mek.configure(workspace_pool_bytes=64 * 1024)
    errors = []

    def work(tid):
        try:
            for i in range(200):
                stream = f"stream{tid % 2}"
                n = 256 + 16 * ((tid * 7 + i) % 32)
                buf = workspace.take(("role", i % 3), n, device="cpu", stream=stream)
                assert buf.numel() == n
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = workspace.stats()
    assert s["hits"] + s["misses"] == 8 * 200
    assert s["buffers"] == 2 * 3  # one per (stream, role)
    held = s["held_bytes"]
    assert held <= 64 * 1024
    assert mek.release() == held
