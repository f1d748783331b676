"""The agent of `pos run`: libposhook.so (hook/), preloaded into the job, owns its device memory
and gates its calls; control.py is pos's side of its control socket."""

RUN_NAME_ENV = "POS_RUN_NAME"       # `pos run --name`; the scheduler resolves names through it
# `pos run` says to the job's tree whether it let it have io_uring ("allowed") or not ("refused",
# pos/agent/seccomp.py), so that a refusal of the tree's io_uring names the right fix
IO_URING_ENV = "POS_RUN_IO_URING"
