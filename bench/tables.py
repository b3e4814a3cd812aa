"""Turning results into the comparison table and the target checks (plain text and Markdown).

Every ratio is *zarrlake's time divided by the other system's time* on the same backend, in the
same run: below 1 means zarrlake is faster. Targets are written in the same terms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workloads import Sizes

COLUMNS = ["zarr-local", "zarrlake-local", "icechunk-local", "zarrlake-s3", "icechunk-s3"]
RATIOS = [
    ("zl/zarr local", "zarrlake-local", "zarr-local"),
    ("zl/ic local", "zarrlake-local", "icechunk-local"),
    ("zl/ic s3", "zarrlake-s3", "icechunk-s3"),
]

Results = dict[str, dict[str, dict[str, Any]]]


@dataclass
class Row:
    label: str
    values: dict[str, float | None]  # numbers compared by the ratio columns
    fmt: Callable[[float], str]
    text: dict[str, str] | None = None  # shown instead of the number (e.g. "4/4")
    ratios: bool = True


@dataclass
class Target:
    name: str
    measured: float | None
    limit: float
    op: str  # "<=" or "=="
    shown: str = ""

    @property
    def result(self) -> str:
        if self.measured is None:
            return "n/a"
        ok = self.measured <= self.limit if self.op == "<=" else self.measured == self.limit
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


def _row(res: Results, bench: str, label: str, fmt: Callable[[float], str], *path: str) -> Row:
    return Row(label, {c: _get(res, bench, c, *path) for c in COLUMNS}, fmt)


def build_rows(res: Results, sizes: Sizes) -> list[Row]:
    rows: list[Row] = []
    if "bulk" in res:
        mib = sizes.bulk_mib
        rows.append(_row(res, "bulk", f"bulk write {mib} MiB (1 MiB chunks)", _s, "write_s"))
        rows.append(_row(res, "bulk", f"bulk read {mib} MiB", _s, "read_s"))
    if "small" in res:
        n, kib = sizes.small_chunks, sizes.small_chunk_bytes // 1024
        rows.append(_row(res, "small", f"write {n:,} x {kib} KiB chunks", _s, "write_s"))
        rows.append(_row(res, "small", f"read {n:,} x {kib} KiB chunks", _s, "read_s"))
    if "random" in res:
        rows.append(_row(res, "random", "random single-chunk read (per read)", _ms, "read_ms"))
    if "commit" in res:
        for n in sizes.commit_sizes:
            rows.append(
                _row(res, "commit", f"1-chunk commit, {n:,}-chunk repo", _ms, str(n), "txn_ms")
            )
        lo, hi = min(sizes.commit_sizes), max(sizes.commit_sizes)
        growth = _row(res, "commit", f"commit growth {hi // 1000}k / {lo // 1000}k", _x, "growth")
        growth.ratios = False
        rows.append(growth)
    if "log" in res:
        n = sizes.log_commits
        rows.append(_row(res, "log", f"{n} sequential commits (per commit)", _ms, "commit_ms"))
        rows.append(_row(res, "log", f"log() of {n}+ commits, fresh client", _ms, "log_ms"))
        rows.append(_row(res, "log", "checkout of an old commit + full read", _ms, "checkout_ms"))
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
    va, vb = row.values.get(a), row.values.get(b)
    if not row.ratios or va is None or vb is None or vb == 0:
        return None
    return va / vb


def build_targets(res: Results, sizes: Sizes) -> list[Target]:
    t: list[Target] = []

    def ratio(bench: str, a: str, b: str, *path: str) -> float | None:
        va, vb = _get(res, bench, a, *path), _get(res, bench, b, *path)
        return None if va is None or vb is None or vb == 0 else va / vb

    for bench, key, what in [
        ("bulk", "write_s", "bulk write"),
        ("bulk", "read_s", "bulk read"),
    ]:
        if bench in res:
            t.append(
                Target(
                    f"{what}: ≥ 0.9x raw Zarr speed (local)",
                    ratio(bench, "zarrlake-local", "zarr-local", key),
                    1 / 0.9,
                    "<=",
                )
            )
            for be in ("local", "s3"):
                t.append(
                    Target(
                        f"{what}: at least as fast as Icechunk ({be})",
                        ratio(bench, f"zarrlake-{be}", f"icechunk-{be}", key),
                        1.0,
                        "<=",
                    )
                )
    for bench, key, what in [
        ("small", "write_s", "small-chunk write"),
        ("small", "read_s", "small-chunk read"),
        ("random", "read_ms", "random single-chunk read"),
    ]:
        if bench in res:
            for be in ("local", "s3"):
                t.append(
                    Target(
                        f"{what}: at least as fast as Icechunk ({be})",
                        ratio(bench, f"zarrlake-{be}", f"icechunk-{be}", key),
                        1.0,
                        "<=",
                    )
                )
    if "commit" in res:
        lo, hi = min(sizes.commit_sizes), max(sizes.commit_sizes)
        for be in ("local", "s3"):
            t.append(
                Target(
                    f"1-chunk commit, {hi:,} / {lo:,} chunks ≤ 1.5x ({be})",
                    _get(res, "commit", f"zarrlake-{be}", "growth"),
                    1.5,
                    "<=",
                )
            )
    if "log" in res:
        t.append(
            Target(
                f"log() of {sizes.log_commits} commits on S3 ≤ ½ of Icechunk's",
                ratio("log", "zarrlake-s3", "icechunk-s3", "log_ms"),
                0.5,
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


def _cells(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    present = [c for c in COLUMNS if any(r.values.get(c) is not None for r in rows)]
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


def _target_cells(targets: list[Target]) -> list[list[str]]:
    out = []
    for t in targets:
        shown = t.shown or ("—" if t.measured is None else f"{t.measured:.2f}")
        limit = f"{t.op} {t.limit:.2f}" if t.op == "<=" else f"= {t.limit:.0f}/{t.limit:.0f}"
        out.append([t.name, shown, limit, t.result])
    return out


def render_text(rows: list[Row], targets: list[Target]) -> str:
    header, body = _cells(rows)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), line(["-" * w for w in widths]), *(line(b) for b in body)]
    out.append("")
    out.append("ratios: zarrlake time / other time, same backend, same run (< 1: zarrlake faster)")
    out.append("")
    tb = [["target", "measured", "limit", "result"], *_target_cells(targets)]
    tw = [max(len(r[i]) for r in tb) for i in range(4)]
    for i, r in enumerate(tb):
        out.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w)
                for j, (c, w) in enumerate(zip(r, tw, strict=True))
            )
        )
        if i == 0:
            out.append("  ".join("-" * w for w in tw))
    return "\n".join(out)


def render_markdown(rows: list[Row], targets: list[Target], meta: dict[str, Any]) -> str:
    header, body = _cells(rows)

    def md(cells: list[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    out = [
        f"Measured {meta['date']} on {meta['machine']}; {meta['mode']} run, "
        f"zarr {meta['versions']['zarr']}, icechunk {meta['versions']['icechunk']}, "
        f"zarrlake {meta['versions']['zarrlake']}; S3 = moto_server on loopback.",
        "",
        md(header),
        md(["---", *(["---:"] * (len(header) - 1))]),
        *(md(b) for b in body),
        "",
        "Ratios are zarrlake's time / the other system's time on the same backend in the same run "
        "(below 1: zarrlake is faster).",
        "",
        md(["target", "measured", "limit", "result"]),
        md(["---", "---:", "---:", ":---:"]),
        *(md(r) for r in _target_cells(targets)),
        "",
    ]
    return "\n".join(out)
