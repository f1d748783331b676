"""A process tree back from a whole-process image, for either engine: what this host must hold
first (preflight.py), the ports a restored listener needs freed (timewait.py), and CRIU's and
the driver's restore as steps with their undo (tree.py)."""
