"""The scheduler tests' fixtures (processes to checkpoint, pos run as a command) serve here too."""

from tests.scheduler.conftest import *  # noqa: F401,F403
