import os
import sys

# Tests run from a checkout without installing (the Makefile also sets PYTHONPATH=src).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
