"""``zarrlake expire``, ``gc`` and ``compact``: the maintenance that a RetentionPolicy's
Kubernetes CronJobs run.

Each prints its report (a summary line, or the JSON document with ``--json``) and, when
``$ZARRLAKE_REPORT_FILE`` is set, also writes the run's :class:`~zarrlake.jobreport.JobReport`
there: Kubernetes jobs point it at ``/dev/termination-log``, which is how the operator learns
each run's result.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from zarrlake.cli.args import (
    MAIN,
    Commands,
    UsageError,
    add_json,
    add_lock,
    duration,
    size,
)
from zarrlake.cli.connect import open_repository
from zarrlake.cli.output import ProgressDisplay, print_json, print_table, say, warn
from zarrlake.errors import ZarrlakeError
from zarrlake.jobreport import JobReport, job_document
from zarrlake.maintenance import InvalidRetentionRules, RetentionRules
from zarrlake.units import format_bytes

# -- expire --------------------------------------------------------------------------------------


def add_expire(commands: Commands) -> None:
    p = commands.add(
        "expire", run_expire, "take snapshots outside the retention rules out of history"
    )
    p.add_argument(
        "--rules", required=True, metavar="RULES", help="retention rules: JSON/YAML file or JSON"
    )
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    add_json(p)
    add_lock(p)


def run_expire(args: argparse.Namespace) -> None:
    rules = _rules(args.rules)  # InvalidRetentionRules: one line, exit 2
    repo = open_repository(args, locked=True)
    report = repo.expire(rules, dry_run=args.dry_run)
    _write_job_report(JobReport.from_reports(report))
    if args.json:
        print_json(report.to_json())
    else:
        say(report.summary())


def _rules(text: str) -> RetentionRules:
    """``--rules``: a JSON/YAML file, or the rules inline as a JSON object."""
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise InvalidRetentionRules(f"inline --rules is not valid JSON: {e}") from None
        return RetentionRules.from_dict(doc)
    return RetentionRules.from_file(text)


# -- gc ------------------------------------------------------------------------------------------


def add_gc(commands: Commands) -> None:
    p = commands.add("gc", run_gc, "delete objects no retained snapshot needs")
    p.add_argument(
        "--rules", default=None, metavar="RULES", help="expire by these rules first (file or JSON)"
    )
    p.add_argument("--grace", default="7d", help="only delete objects older than this (default 7d)")
    p.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    p.add_argument(
        "--force", action="store_true", help="allow a grace shorter than the session lifetime"
    )
    _add_engine(p)
    add_json(p)
    add_lock(p)


def _add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=("local", "spark"),
        default="local",
        help="local: in this process; spark: as a Spark job (default local)",
    )
    p.add_argument(
        "--spark-master",
        default=None,
        metavar="URL",
        help="with --engine spark: the master (default: what spark-submit configured)",
    )


def _spark_session(args: argparse.Namespace) -> Any:
    """The SparkSession ``--engine spark`` runs on: the one ``spark-submit`` configured (its
    ``--master``), or ``--spark-master``; None for ``--engine local``."""
    if args.engine != "spark":
        if args.spark_master:
            raise UsageError("--spark-master goes with --engine spark")
        return None
    from zarrlake.maintenance.spark_jobs import spark_session

    try:
        return spark_session(f"zarrlake-{args.command}", args.spark_master)
    except ImportError as e:
        raise UsageError(f"--engine spark: {e}") from None
    except Exception as e:
        if not _from_spark(e):
            raise  # zarrlake's own bug: not to be passed off as Spark's
        where = f" on {args.spark_master!r}" if args.spark_master else ""
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ZarrlakeError(f"--engine spark: cannot start Spark{where}: {detail}") from None


def _from_spark(e: BaseException) -> bool:
    """Whether ``e`` is Spark's or the JVM's (PySpark, Py4J, no Java), not zarrlake's."""
    module = type(e).__module__
    return module.startswith(("pyspark", "py4j")) or isinstance(e, OSError)


def run_gc(args: argparse.Namespace) -> None:
    grace = duration(args.grace)
    rules = _rules(args.rules) if args.rules else None
    spark = _spark_session(args)
    repo = open_repository(args, locked=True)
    expired = repo.expire(rules, dry_run=args.dry_run) if rules is not None else None
    with ProgressDisplay(not args.json and spark is None) as progress:
        report = repo.gc(
            grace=grace,
            dry_run=args.dry_run,
            force=args.force,
            progress=progress,
            engine=args.engine,
            spark=spark,
        )
    _write_job_report(JobReport.from_reports(report, expired))
    if args.json:
        print_json(job_document(report, expired))
        return
    if expired is not None:
        say(expired.summary())
    say(report.summary())
    rows = [
        [
            kind,
            str(c.deleted),
            format_bytes(c.deleted_bytes),
            str(c.kept),
            format_bytes(c.kept_bytes),
        ]
        for kind, c in report.by_kind.items()
    ]
    print_table(["KIND", "DELETED", "BYTES", "KEPT", "BYTES"], rows)


# -- compact -------------------------------------------------------------------------------------


def add_compact(commands: Commands) -> None:
    p = commands.add("compact", run_compact, "pack small chunks, merge shards, prune the journal")
    p.add_argument("--branch", default=MAIN, help="branch to compact (default: main)")
    p.add_argument(
        "--pack-below",
        type=size,
        default=None,
        metavar="BYTES",
        help="pack chunk objects smaller than this: 262144, 256KiB, 1MiB (default 256 KiB)",
    )
    p.add_argument(
        "--keep-journal",
        default="7d",
        metavar="DURATION",
        help="keep branch-journal entries (as_of) this far back (at least 8d, whatever is given)",
    )
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    p.add_argument(
        "--materialize",
        action="store_true",
        help="first copy every virtual chunk of the branch into the repository (one commit; "
        "the sources are read, checked against their pins, never changed)",
    )
    _add_engine(p)
    add_json(p)
    add_lock(p)


def run_compact(args: argparse.Namespace) -> None:
    keep = duration(args.keep_journal)
    spark = _spark_session(args)
    repo = open_repository(args, locked=True)
    with ProgressDisplay(not args.json and spark is None) as progress:
        report = repo.compact(
            branch=args.branch,
            pack_below_bytes=args.pack_below,
            keep_journal=keep,
            dry_run=args.dry_run,
            progress=progress,
            engine=args.engine,
            spark=spark,
            materialize=args.materialize,
        )
    _write_job_report(JobReport.from_reports(report))
    if args.json:
        print_json(report.to_json())
    else:
        say(report.summary())


# -- shared --------------------------------------------------------------------------------------


def _write_job_report(report: JobReport) -> None:
    """Write ``report`` where ``$ZARRLAKE_REPORT_FILE`` says, if it says; a file that cannot be
    written is a warning, not a failure: the work is done."""
    path = os.environ.get("ZARRLAKE_REPORT_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(report.to_message())
    except OSError as e:  # stderr: stdout may be a --json document
        warn(f"cannot write report to {path}: {e.strerror}")
