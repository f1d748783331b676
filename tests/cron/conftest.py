"""The engines' fixtures (processes to checkpoint, pos run as a command) serve here too."""

from tests.engines.conftest import *  # noqa: F401,F403
