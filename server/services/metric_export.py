"""Stored metric points of one or more runs as a CSV or Parquet file (``GET /api/runs/{id}/metrics/export``,
``GET /api/metrics/export?run=..``, and the dashboard's download links).

The file is long-format, one row per stored point, ordered by run, name, source, step:

| column | type | meaning |
|---|---|---|
| ``run_id`` | int32 | the run |
| ``source`` | string | process that measured it (``trainer``, ``orchestrator``, ``eval``, ...) |
| ``step`` | int64 | step |
| ``name`` | string | metric name |
| ``value`` | float64 | the stored value; non-finite (NaN, inf) is null, as in ``GET .../metrics`` |
| ``time`` | float64 | unix seconds when the process measured it |

Postgres writes the CSV itself (``COPY (SELECT ...) TO STDOUT``, non-finite values as empty); the Parquet file is that
CSV parsed by pyarrow with ``SCHEMA`` and written with zstd: no Python object per point (a row-by-row fetch took
~3 s per 100k points on the 2-core box, ``benchmarks/metric_export.py``). SQLite (embedded mode) reads rows in chunks
of ``CHUNK`` into pyarrow batches instead.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from typing import Literal

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from psycopg import sql
from sqlalchemy import bindparam, text
from sqlmodel import Session

ExportFormat = Literal["csv", "parquet"]
MEDIA_TYPES: dict[str, str] = {"csv": "text/csv; charset=utf-8", "parquet": "application/vnd.apache.parquet"}
MAX_RUNS = 20
"""Most runs one export (a comparison) takes."""
MAX_NAMES = 100
"""Most metric names one export selects (none: every metric)."""
SORT_MEMORY = "64MB"
"""Postgres ``work_mem`` of an export's transaction: 100k points sort in ~12 MB (the default 4 MB spills to disk)."""
CHUNK = 50_000
"""Rows fetched and written at a time."""

SCHEMA = pa.schema(
    [
        ("run_id", pa.int32()),
        ("source", pa.string()),
        ("step", pa.int64()),
        ("name", pa.string()),
        ("value", pa.float64()),
        ("time", pa.float64()),
    ]
)


class MetricNotFound(LookupError):
    """A metric asked for by name that none of the runs has (404, naming it)."""


def check_names(session: Session, *, run_ids: Sequence[int], names: Sequence[str]) -> None:
    """Every name in ``names`` is stored for at least one of ``run_ids``.

    Raises:
        MetricNotFound: ``name: no run of <ids> has a metric '<name>' (it has: ...)``, the first missing one.
    """
    if not names:
        return
    stmt = text("SELECT DISTINCT name FROM metrics WHERE run_id IN :ids AND name IN :names").bindparams(
        bindparam("ids", expanding=True), bindparam("names", expanding=True)
    )
    found = set(session.execute(stmt, {"ids": list(run_ids), "names": list(names)}).scalars())
    missing = [n for n in names if n not in found]
    if missing:
        every = text("SELECT DISTINCT name FROM metrics WHERE run_id IN :ids ORDER BY name LIMIT 21").bindparams(
            bindparam("ids", expanding=True)
        )
        have = list(session.execute(every, {"ids": list(run_ids)}).scalars())
        shown = ", ".join(have[:20]) + (", ..." if len(have) > 20 else "") if have else "none"
        runs = ", ".join(str(i) for i in run_ids)
        raise MetricNotFound(f"name: no run of {runs} has a metric {missing[0]!r} (it has: {shown})")


def batches(session: Session, *, run_ids: Sequence[int], names: Sequence[str] = ()) -> Iterator[pa.RecordBatch]:
    """The stored points of ``run_ids`` (only the metrics ``names``, when given) as record batches of ``SCHEMA``,
    at most ``CHUNK`` rows each, ordered by run, name, source, step."""
    where = "run_id IN :ids" + (" AND name IN :names" if names else "")
    stmt = text(
        f"SELECT run_id, source, step, name, value, time FROM metrics WHERE {where} ORDER BY run_id, name, source, step"
    ).bindparams(bindparam("ids", expanding=True), *([bindparam("names", expanding=True)] if names else []))
    params: dict[str, list[int] | list[str]] = {"ids": list(run_ids)}
    if names:
        params["names"] = list(names)
    result = session.execute(stmt, params)
    while rows := result.fetchmany(CHUNK):
        run_id, source, step, name, value, t = zip(*rows, strict=True)
        values = [v if math.isfinite(v) else None for v in value]
        yield pa.record_batch([list(run_id), list(source), list(step), list(name), values, list(t)], schema=SCHEMA)


def postgres_csv(session: Session, *, run_ids: Sequence[int], names: Sequence[str] = ()) -> bytes:
    """The CSV (header row, then ``SCHEMA``'s columns) of the points of ``run_ids`` (only ``names`` when given), in
    the order of :func:`batches`, written by Postgres (``COPY ... TO STDOUT``). float8 text is the shortest that
    reads back to the same double (Postgres >= 12); NaN and infinities are written empty (null)."""
    where = sql.SQL("run_id = ANY({ids})").format(ids=sql.Literal(list(run_ids)))
    if names:
        where = sql.SQL("{} AND name = ANY({names})").format(where, names=sql.Literal(list(names)))
    query = sql.SQL(
        "COPY (SELECT run_id, source, step, name,"
        " CASE WHEN value IN ('NaN', 'Infinity', '-Infinity') THEN NULL ELSE value END AS value, time"
        " FROM metrics WHERE {where} ORDER BY run_id, name, source, step) TO STDOUT (FORMAT csv, HEADER)"
    ).format(where=where)
    session.execute(text(f"SET LOCAL work_mem = '{SORT_MEMORY}'"))  # this transaction: sort in memory, not on disk
    raw = session.connection().connection.driver_connection
    sink = io.BytesIO()
    with raw.cursor() as cur, cur.copy(query) as copy:  # type: ignore[union-attr]  # psycopg: the Postgres driver
        for chunk in copy:
            sink.write(chunk)
    return sink.getvalue()


def export(session: Session, *, run_ids: Sequence[int], names: Sequence[str] = (), fmt: ExportFormat = "csv") -> bytes:
    """The file (``fmt``: ``csv`` with a header row, or ``parquet``) of the stored points of ``run_ids``, every
    metric or only ``names``. The runs must exist (the caller looked them up).

    Raises:
        MetricNotFound: a name in ``names`` that none of the runs has.
    """
    check_names(session, run_ids=run_ids, names=names)
    if session.get_bind().dialect.name == "postgresql":
        text_csv = postgres_csv(session, run_ids=run_ids, names=names)
        if fmt == "csv":
            return text_csv
        options = pa_csv.ConvertOptions(
            column_types=SCHEMA, strings_can_be_null=False, quoted_strings_can_be_null=False
        )
        table = pa_csv.read_csv(pa.BufferReader(text_csv), convert_options=options)
        sink = io.BytesIO()
        pq.write_table(table.cast(SCHEMA), sink, compression="zstd")
        return sink.getvalue()
    sink = io.BytesIO()
    if fmt == "csv":
        with pa_csv.CSVWriter(sink, SCHEMA) as csv_writer:
            for batch in batches(session, run_ids=run_ids, names=names):
                csv_writer.write_batch(batch)
    else:
        with pq.ParquetWriter(sink, SCHEMA, compression="zstd") as pq_writer:
            for batch in batches(session, run_ids=run_ids, names=names):
                pq_writer.write_batch(batch)
    return sink.getvalue()


def filename(run_ids: Sequence[int], fmt: ExportFormat) -> str:
    """``run-3-metrics.csv``, or ``runs-3-5-8-metrics.parquet`` for a comparison."""
    ids = "-".join(str(i) for i in run_ids)
    return f"{'run' if len(run_ids) == 1 else 'runs'}-{ids}-metrics.{fmt}"
