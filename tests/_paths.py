"""Where the checkout is, for tests that start a fresh Python process in it."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root (this file is tests/_paths.py)
