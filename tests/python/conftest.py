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
    """The fault demo, with every injected fault cleared after the test."""
    fault_demo.clear_faults()
    yield fault_demo
    fault_demo.clear_faults()
