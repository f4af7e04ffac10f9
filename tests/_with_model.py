"""Run an entry script with one more model in model.MODELS, as a user registers their own. Not a product file.

    python tests/_with_model.py NAME MODULE:ATTR SCRIPT ARGS...

MODULE is a module of tests/ (a test file), ATTR its model constructor (num_classes -> nn.Module);
SCRIPT runs as `python SCRIPT ARGS...` would, under torchrun too. A test that asserts on what the run
prints or how it exits thus runs it as a process of its own.
"""
import importlib
import runpy
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]
import model  # noqa: E402

if __name__ == "__main__":
    name, spec, script, *args = sys.argv[1:]
    module, attr = spec.split(":")
    model.MODELS[name] = getattr(importlib.import_module(module), attr)
    sys.argv = [script, *args]
    runpy.run_path(str(TESTS.parent / script), run_name="__main__")
