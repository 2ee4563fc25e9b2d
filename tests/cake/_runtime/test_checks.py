"""The shared host checks of `_runtime/checks.py` that no single op's tests cover."""
import pytest
import torch


def test_check_cu_seqlens():
    from miles_ext_kernels.cake._runtime.checks import check_cu_seqlens

    ok = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    assert check_cu_seqlens("cu", ok, 12).tolist() == [0, 3, 3, 10]
    assert check_cu_seqlens("cu", ok, 10, must_end_at_total=True).dtype == torch.int64
    for bad, T, exact, msg in ((torch.tensor([1, 3]), 5, False, "^cu must start at 0"),
                               (torch.tensor([], dtype=torch.int64), 5, False, "^cu must start at 0"),
                               (torch.tensor([0, 4, 3]), 5, False, "^cu must be non-decreasing"),
                               (torch.tensor([0, 6]), 5, False, "^cu ends at 6; it must end within the 5 tokens"),
                               (torch.tensor([0, 4]), 5, True, "^cu ends at 4; it must end exactly at the 5")):
        with pytest.raises(ValueError, match=msg):
            check_cu_seqlens("cu", bad, T, must_end_at_total=exact)
