"""The ground under every engine: a process tree as /proc shows it (procs.py), and the two tools
outside pos that stop, save and bring it back: CRIU for its CPU state (criu.py) and the CUDA
driver's checkpoint API for its GPU state (cudackpt.py)."""
