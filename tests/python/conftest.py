"""Starts `keel demo` (simulated fleet + gateway) for the SDK tests."""
import pytest

from keel_demo import start_demo


@pytest.fixture(scope="session")
def keel_demo():
    demo = start_demo(sim_range=(20000, 32000))
    yield demo.url
    demo.stop()


@pytest.fixture(scope="session")
def fault_demo():
    """A demo of its own for the tests that inject faults, so that they disturb no other test."""
    demo = start_demo()
    yield demo
    demo.stop()


@pytest.fixture
def faults(fault_demo):
    """The fault demo, with every injected fault cleared after the test. Safe mode is held off:
    these tests break streams on purpose, many in a minute, and a pool whose share of migrated
    streams turns red would enter safe mode by itself and stop the very migrations they check
    (safe mode has tests of its own)."""
    fault_demo.clear_faults()
    fault_demo.safe_mode("off")
    yield fault_demo
    fault_demo.clear_faults()
