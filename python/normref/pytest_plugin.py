"""normref's pytest plugin, found through the entry point 'normref' of the group pytest11
(installed by pip and by make install), or loaded with -p normref.pytest_plugin.

It gives the fixture ``normref`` (the package, whose assert_matches_reference a test
calls), the option --normref-vectors DIR (the test vectors to use), and a line of the
header naming the library and the vectors."""
import os

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("normref")
    group.addoption("--normref-vectors", metavar="DIR", default=None,
                    help="the folder of normref's test vectors (normref vectors --out DIR); "
                         "default: $NORMREF_VECTORS, the installed copy, or a cached one")


def pytest_configure(config):
    d = config.getoption("--normref-vectors", default=None)
    if d:
        os.environ["NORMREF_VECTORS"] = d


def pytest_report_header(config):
    try:
        import normref
        return f"normref: {normref.LIBRARY_PATH}"
    except ImportError as e:
        return f"normref: {str(e).splitlines()[0]}"


@pytest.fixture
def normref():
    """the normref package: normref.assert_matches_reference(fn, op=..., precision=...)"""
    import normref as package
    return package
