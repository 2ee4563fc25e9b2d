"""check_supported of gdn and kda (one rule, the delta rule's): what each accepts and what each refuses, torch-free."""
import pytest

from miles_ext_kernels.cake import gdn, kda

OPS = {"gdn": gdn, "kda": kda}


@pytest.mark.parametrize("op", sorted(OPS))
def test_check_supported_accepts(op):
    for kd in (16, 32, 64, 128):
        for vd in (16, 32, 64, 128):
            OPS[op].check_supported(kd, vd)
    OPS[op].check_supported(128, 128, 16, 32)  # GVA: 16 key heads, 32 value heads


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("args, exc, word", [
    ((256, 128), ValueError, "head_k_dim"),
    ((128, 96), ValueError, "head_v_dim"),
    ((128, 128, 3, 4), ValueError, "num_v_heads"),
    ((128, 128, 0, 4), ValueError, "num_k_heads"),
    ((True, 128), TypeError, "head_k_dim"),
    ((128.0, 128), TypeError, "head_k_dim"),
])
def test_check_supported_rejects(op, args, exc, word):
    with pytest.raises(exc, match=word):
        OPS[op].check_supported(*args)
