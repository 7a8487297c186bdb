"""The dashboard's browser tests reuse the SDK tests' demo launcher (tests/python/keel_demo.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
