"""pos run's bootstrap: started by Python through this directory on PYTHONPATH.

Starts the pos agent when POS_AGENT=1, then runs the sitecustomize this one hides (the next on
sys.path), so that a program's own site customisation still happens.
"""

import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        path = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_pos_chained_sitecustomize", path)
            if spec and spec.loader:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


if os.environ.get("POS_AGENT") == "1":
    os.environ.pop("POS_AGENT")          # children of the program start no agent of their own
    from pos.agent.server import start

    start()
_chain()
