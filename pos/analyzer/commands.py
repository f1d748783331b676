"""`pos analyze`: the analysis of a recorded trace (read/write sets, DAG, iteration, copy order
and costs). numba and the store are imported inside the command."""

import sys
from typing import Optional

import click

from pos.usage import PosCommand, PosPath

EPILOG_ANALYZE = """\b
Examples:
  pos analyze /tmp/t.db                       # report of the latest trace
  pos analyze /tmp/t.db --trace 3 --top 20    # another trace, longer tables
  pos analyze /tmp/t.db --json > access.json  # every launch's read/write sets, buffers, costs
  pos analyze /tmp/t.db --dot dag.svg         # one iteration of the DAG (DOT without graphviz)
  pos analyze /tmp/t.db --validation val.json # list what the run-time validator caught
"""


@click.command(cls=PosCommand, epilog=EPILOG_ANALYZE)
@click.argument("file", type=PosPath(dir_okay=False))
@click.option("--trace", "trace_id", type=int, help="Trace id [default: the latest].")
@click.option("--json", "as_json", is_flag=True, help="Print the analysis as JSON.")
@click.option("--dot", "dot", type=PosPath(dir_okay=False),
              help="Write one iteration of the DAG here (.svg: rendered with graphviz's dot).")
@click.option("--top", type=click.IntRange(1), default=10, show_default=True,
              help="Rows of the report's tables.")
@click.option("--validation", type=PosPath(dir_okay=False),
              help="JSON table of the run-time validator (pos.analyzer.validate).")
def analyze(file: str, trace_id: Optional[int], as_json: bool, dot: Optional[str], top: int,
            validation: Optional[str]) -> None:
    """Speculate every launch's and copy's read and write sets from a recorded trace, build the
    buffer DAG, find the training/serving iteration, and predict a checkpoint's copy order and
    costs (stop-the-world vs concurrent)."""
    from pos.analyzer import analyze_file, load_validation
    from pos.analyzer.report import check_writable, dump_json, print_report, to_json, write_dot

    if dot:
        check_writable(dot, "--dot")     # before the analysis, not after its report
    table = load_validation(validation) if validation else None
    tid, result = analyze_file(file, trace_id)
    if as_json:
        dump_json(to_json(result, tid, table), sys.stdout)
    else:
        print_report(result, tid, sys.stdout, top=top, validation=table)
    if dot:
        click.echo(write_dot(result, dot), err=True)
