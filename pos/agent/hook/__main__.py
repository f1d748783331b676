"""`python -m pos.agent.hook`: build the preload library now (scripts/setup.sh runs this)."""

from pos.agent.hook import build

print(build(force=True))
