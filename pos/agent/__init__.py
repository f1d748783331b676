"""The agent of `pos run`: libposhook.so (hook/), preloaded into the job, owns its device memory
and gates its calls; control.py is pos's side of its control socket."""

RUN_NAME_ENV = "POS_RUN_NAME"       # `pos run --name`; the scheduler resolves names through it
