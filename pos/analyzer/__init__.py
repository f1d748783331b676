"""`pos analyze`: speculative access sets of launches and copies, the buffer DAG, iterations,
checkpoint copy order and predicted costs, and the run-time validator of the speculation."""

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from pos.analyzer.dag import Analysis


def analyze_file(path: str, trace_id: Optional[int] = None) -> "tuple[int, Analysis]":
    """(trace id, dag.Analysis) of a trace in the store at `path` (the latest by default)."""
    from pos.analyzer.access import speculate
    from pos.analyzer.dag import analyze
    from pos.analyzer.load import load_trace
    from pos.store.db import open_db

    trace_id, ops = load_trace(open_db(path, create=False), trace_id)
    return trace_id, analyze(ops, speculate(ops))


def load_validation(path: str) -> dict:
    """The run-time validator's saved table (validate.Validator.save)."""
    import json

    from pos.errors import BadInput

    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        raise BadInput(f"cannot read the validation table {path} ({e})",
                       "give the JSON file that the validator saved") from None
    if not isinstance(table, dict) or not isinstance(table.get("kernels"), dict):
        raise BadInput(f"{path} is not a validation table", "give the JSON file that the validator saved")
    return table
