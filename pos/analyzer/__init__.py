"""`pos analyze`: speculative access sets of launches and copies, the buffer DAG, iterations,
checkpoint copy order and predicted costs, and the run-time validator of the speculation."""
