"""pos's side of taking a job's imports down and putting them back, as a process of its own that
dies (SIGKILL) at one step: what the agents do when pos vanishes there
(test_peer_fake.py: every process runs on or ends, never stays held).

  peer_steps.py STEP OWNER IMPORTER    STEP: stamped, down, exported, up
"""

import os
import secrets
import signal
import sys

from pos.agent import peers
from pos.agent.control import Agent


def main() -> None:
    step, owner_pid, importer_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    owner, importer = Agent(owner_pid), Agent(importer_pid)
    for a in (owner, importer):
        a.cut(5)

    def die_at(here: str) -> None:
        if step == here:
            print(f"KILLED AT {here}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    owner.stamp(owner.exports()[0].va, secrets.token_bytes(peers.NONCE))
    die_at("stamped")
    owner.unstamp()
    links = peers.match([owner, importer])
    peers.take_down([owner, importer], links)
    die_at("down")
    fd = owner.peer_export(links[0].owner_va)
    die_at("exported")
    importer.peer_up([fd])
    die_at("up")


if __name__ == "__main__":
    main()
