"""The concurrent engine's tests take their `pos run` jobs over the fake driver from the agent's
fixtures, and CRIU and pos as a command from the engines'."""

from tests.agent.conftest import fill_job, gpu_env, peer_job  # noqa: F401  (fixtures)
from tests.engines.conftest import *  # noqa: F401,F403
