"""Make ``core_helpers`` importable whatever pytest's import mode."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
