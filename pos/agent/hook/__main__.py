"""`python -m pos.agent.hook`: build the preload library now."""

from pos.agent.hook import build

print(build(force=True))
