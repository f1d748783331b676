"""The engines behind one interface (engines.py) and the commands that choose them
(commands.py: `pos checkpoint`, `restore`, `restore-service`, `inspect`, `migrate`): the
stop-the-world engine (stopworld.py), the concurrent and GPU-only engines (pos/concurrent/),
migration (migrate.py), the restore service (service.py, its client and protocol), and what the
commands print (summary.py)."""
