"""Scheduled snapshots: `pos schedule` stores when to checkpoint which job (times.py: when a
schedule fires; targets.py: which process it means), `pos daemon` runs them (daemon.py, each
snapshot in a process of its own: snapshot.py, through either engine of pos/engines/), keeps
what retention.py says and drops the rest; `pos images` lists and prunes what they made."""
