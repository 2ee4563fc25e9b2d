"""Fixtures shared by every test under tests/cake.

Each test starts and ends on the default configuration (`mek.configure()`): no test sees another's variants,
options or workspace pool bound. A test that needs synthetic ops registered for its duration names them with the
`registered_ops` marker, on the test or on its module:

    pytestmark = pytest.mark.registered_ops(SYNTHETIC, FAST_ONLY)

The shipped ops (`registry.OPS`) are always registered and need no marker.
"""
import contextlib

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels.cake._runtime import registry


@pytest.fixture(autouse=True)
def _default_configuration(request):
    """Default configuration before and after the test; the `registered_ops` specs registered around it."""
    specs = {}
    for marker in request.node.iter_markers("registered_ops"):
        for spec in marker.args:
            specs.setdefault(spec.name, spec)  # a spec named on both the test and its module is registered once
    mek.configure()
    with contextlib.ExitStack() as stack:
        for spec in specs.values():
            stack.enter_context(registry.registered(spec))  # registered() also resets the configuration
        yield
    mek.configure()
