"""Malformed cu_seqlens through gqa, conv1d (with and without an initial state), gdn and kda on CPU (interpreter):
no crash, and every output row the op writes is finite although each operand sits between NaN guard rows (see
tests/cake/_malformed.py; on a GPU the same cases run under compute-sanitizer)."""
import pytest
import torch

from tests.cake._malformed import RUNNERS, all_cases, non_finite

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("op", sorted(RUNNERS))
@pytest.mark.parametrize("label, cu, dtype", all_cases(), ids=[c[0] for c in all_cases()])
def test_malformed_cu_seqlens_stay_inside_the_tensors(op, label, cu, dtype):
    outs = RUNNERS[op](cu, dtype, "cpu")
    assert not non_finite(outs), (op, label, non_finite(outs))


def test_guard_rows_would_be_seen():
    """The check can fail: an operand read one row before its start brings a guard NaN into the output."""
    from tests.cake import _malformed as m

    x = m._guarded((m.T, 4), torch.float32, "cpu", torch.Generator().manual_seed(0))
    before = torch.as_strided(x, (m.T, 4), x.stride(), x.storage_offset() - 4)
    assert non_finite({"y": before.sum(1)}) == ["y"] and not non_finite({"y": x.sum(1)})
