"""
The report as one self-contained HTML file: tables and inline SVG charts,
no scripts, fonts or anything else fetched, so it reads offline.

Everything here runs on the driver over the few rows the report collected.
"""

import html
import math
from datetime import UTC, datetime

from dallal_analytics.questions import BUCKETS_PER_DECADE

WIDTH = 760
HEIGHT = 240
MARGIN_LEFT = 64
MARGIN_RIGHT = 16
MARGIN_TOP = 16
MARGIN_BOTTOM = 40
TICKS = 5
COLORS = ("#1f6fb2", "#d9782d", "#3a9a5b", "#9b4dca")

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { padding: 0.2em 0.7em; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
.figures { display: flex; flex-wrap: wrap; gap: 0.5em; }
.figure { border: 1px solid #ddd; border-radius: 4px; padding: 0.4em 0.8em; min-width: 8em; }
.figure b { display: block; font-size: 1.4em; }
svg text { font: 11px sans-serif; fill: #444; }
.ok { color: #3a9a5b; } .bad { color: #c0392b; }
"""


def utc(moment):
    """
    A timestamp collected from Spark (naive, in this process's local time)
    as an aware UTC datetime.
    """
    return moment.astimezone(UTC)


def isoformat(moment):
    """
    C{2026-11-21T20:08:19.729858Z}, or None.
    """
    if moment is None:
        return None
    return utc(moment).isoformat().replace("+00:00", "Z")


def escape(value):
    return html.escape(str(value), quote=True)


def number(value):
    """
    An int with thousands separators, a float to 4 significant digits.
    """
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, datetime):
        return utc(value).strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def seconds(value):
    """
    A duration in seconds, in the unit that reads best.
    """
    if value is None:
        return "–"
    if value < 1e-3:
        return f"{value * 1e6:.3g} µs"
    if value < 1:
        return f"{value * 1e3:.3g} ms"
    return f"{value:.3g} s"


def niceStep(span, ticks=TICKS):
    """
    A round step (1, 2 or 5 times a power of ten) giving about C{ticks}
    intervals over C{span}.
    """
    if span <= 0:
        return 1
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def _timeLabel(epoch, span):
    moment = datetime.fromtimestamp(epoch, UTC)
    return moment.strftime(
        "%m-%d %H:%M" if span >= 86400 else "%H:%M:%S" if span < 600 else "%H:%M"
    )


class Plot:
    """
    Maps data to the plot area of one chart and draws its axes.
    """

    def __init__(self, xMin, xMax, yMax):
        self.xMin = xMin
        self.xSpan = (xMax - xMin) or 1
        self.yStep = niceStep(yMax or 1)
        self.yMax = self.yStep * math.ceil((yMax or 1) / self.yStep)
        self.width = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
        self.height = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def x(self, value):
        return MARGIN_LEFT + (value - self.xMin) / self.xSpan * self.width

    def y(self, value):
        return MARGIN_TOP + self.height - value / self.yMax * self.height

    def yAxis(self, label):
        parts = []
        steps = round(self.yMax / self.yStep)
        for index in range(steps + 1):
            value = index * self.yStep
            y = self.y(value)
            parts.append(
                f'<line x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" y1="{y:.1f}" '
                f'y2="{y:.1f}" stroke="#eee"/>'
                f'<text x="{MARGIN_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                f"{escape(number(value))}</text>"
            )
        parts.append(
            f'<text x="12" y="{MARGIN_TOP + self.height / 2:.1f}" text-anchor="middle" '
            f'transform="rotate(-90 12 {MARGIN_TOP + self.height / 2:.1f})">{escape(label)}</text>'
        )
        return "".join(parts)

    def timeAxis(self):
        parts = []
        for index in range(TICKS + 1):
            epoch = self.xMin + self.xSpan * index / TICKS
            x = self.x(epoch)
            parts.append(
                f'<text x="{x:.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" text-anchor="middle">'
                f"{escape(_timeLabel(epoch, self.xSpan))}</text>"
            )
        parts.append(
            f'<text x="{WIDTH / 2}" y="{HEIGHT - 6}" text-anchor="middle">time (UTC)</text>'
        )
        return "".join(parts)


def _svg(title, body):
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}"><title>{escape(title)}</title>'
        f"{body}</svg>"
    )


def _noData(title):
    return _svg(
        title,
        f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data</text>',
    )


def timeChart(title, yLabel, series, step=False):
    """
    Lines over time: C{series} is C{[(name, [(epoch, value), ...])]}.  With
    C{step}, each value holds until the next point.  Points without a time
    (events logged with none) are left out.
    """
    series = [(name, [(x, y) for x, y in data if x is not None]) for name, data in series]
    points = [point for _, data in series for point in data]
    if not points:
        return _noData(title)
    plot = Plot(min(x for x, _ in points), max(x for x, _ in points), max(y for _, y in points))
    parts = [plot.yAxis(yLabel), plot.timeAxis()]
    for index, (name, data) in enumerate(series):
        color = COLORS[index % len(COLORS)]
        coordinates = []
        for position, (x, y) in enumerate(data):
            if step and position:
                coordinates.append(f"{plot.x(x):.1f},{plot.y(data[position - 1][1]):.1f}")
            coordinates.append(f"{plot.x(x):.1f},{plot.y(y):.1f}")
        if len(data) == 1:
            x, y = data[0]
            parts.append(
                f'<circle cx="{plot.x(x):.1f}" cy="{plot.y(y):.1f}" r="3" fill="{color}"/>'
            )
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
            f'points="{" ".join(coordinates)}"/>'
        )
        parts.append(
            f'<rect x="{MARGIN_LEFT + 10 + index * 140}" y="{MARGIN_TOP}" width="10" '
            f'height="10" fill="{color}"/><text x="{MARGIN_LEFT + 24 + index * 140}" '
            f'y="{MARGIN_TOP + 9}">{escape(name)}</text>'
        )
    return _svg(title, "".join(parts))


def barChart(title, yLabel, bars):
    """
    Vertical bars: C{bars} is C{[(label, value, tooltip)]}; a label may be
    empty to leave a bar unlabelled.
    """
    if not bars:
        return _noData(title)
    plot = Plot(0, len(bars), max(value for _, value, _ in bars))
    width = plot.width / len(bars)
    parts = [plot.yAxis(yLabel)]
    for index, (label, value, tooltip) in enumerate(bars):
        x = plot.x(index)
        top = plot.y(value)
        parts.append(
            f'<rect x="{x + 1:.1f}" y="{top:.1f}" width="{max(width - 2, 1):.1f}" '
            f'height="{plot.y(0) - top:.1f}" fill="{COLORS[0]}">'
            f"<title>{escape(tooltip)}</title></rect>"
        )
        if label:
            parts.append(
                f'<text x="{x:.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" text-anchor="middle">'
                f"{escape(label)}</text>"
            )
    return _svg(title, "".join(parts))


def table(columns, rows):
    """
    C{columns} is C{[(key, heading)]}; text cells align left, numbers right.
    """
    if not rows:
        return "<p>None.</p>"
    head = "".join(
        f'<th class="text">{escape(h)}</th>' if i == 0 else f"<th>{escape(h)}</th>"
        for i, (_, h) in enumerate(columns)
    )
    body = []
    for row in rows:
        cells = []
        for key, _ in columns:
            value = row.get(key)
            css = ' class="text"' if isinstance(value, str) else ""
            cells.append(f"<td{css}>{escape(number(value))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _epoch(moment):
    return utc(moment).timestamp() if moment is not None else None


def connectionPoints(rows, stepSeconds):
    """
    Step points from L{connectionsByWindow} rows: each step's peak, and
    where steps without a change lie between two rows, the level the first
    ended with.
    """
    rows = [row for row in rows if row["window_start"] is not None]
    points = []
    for index, row in enumerate(rows):
        start = _epoch(row["window_start"])
        points.append((start, row["peak"]))
        following = rows[index + 1]["window_start"] if index + 1 < len(rows) else None
        if following is not None and _epoch(following) > start + stepSeconds:
            points.append((start + stepSeconds, row["at_end"]))
    return points


def histogramBars(rows):
    """
    Latency buckets as bars, labelled at each power of ten.
    """
    if not rows:
        return []
    byBucket = {row["bucket"]: row for row in rows}
    bars = []
    for bucket in range(min(byBucket), max(byBucket) + 1):
        row = byBucket.get(bucket)
        lower = 10 ** (bucket / BUCKETS_PER_DECADE)
        upper = 10 ** ((bucket + 1) / BUCKETS_PER_DECADE)
        acks = row["acks"] if row else 0
        label = seconds(lower) if bucket % BUCKETS_PER_DECADE == 0 else ""
        bars.append((label, acks, f"{seconds(lower)} – {seconds(upper)}: {acks:,} acks"))
    return bars


def figures(summary):
    shown = (
        ("publishes", "publishes"),
        ("deliveries", "deliveries"),
        ("acked", "acked"),
        ("replaced", "replaced"),
        ("dropped", "dropped"),
        ("inflight", "in flight at the end"),
        ("sessions", "sessions"),
        ("peak_connections", "peak connections"),
        ("errors", "errors"),
        ("clients_dropped", "clients dropped"),
        ("unparsed_lines", "unparsed lines"),
    )
    return (
        '<div class="figures">'
        + "".join(
            f'<div class="figure"><b>{escape(number(summary[key]))}</b>{escape(label)}</div>'
            for key, label in shown
        )
        + "</div>"
    )


def accountCheck(summary):
    resolved = sum(summary[name] for name in ("acked", "fired", "replaced", "dropped"))
    total = resolved + summary["inflight"]
    css = "ok" if total == summary["matched"] else "bad"
    return (
        f'<p class="{css}">matched {summary["matched"]:,} = acked {summary["acked"]:,} '
        f"+ fired {summary['fired']:,} + replaced {summary['replaced']:,} "
        f"+ dropped {summary['dropped']:,} + in flight {summary['inflight']:,}</p>"
    )


def counterCheck(summary, runs):
    mismatches = summary["counter_mismatches"]
    if mismatches:
        listed = ", ".join(
            escape(f"run {m['run']} {m['counter']}: broker {m['broker']}, events {m['log']}")
            for m in mismatches
        )
        return f'<p class="bad">The broker\'s counters disagree with its events: {listed}.</p>'
    if any(run["counters"] for run in runs):
        return '<p class="ok">The broker\'s counters (stats events) agree with its events.</p>'
    return "<p>No stats event: the broker's counters were not logged.</p>"


def render(
    summary,
    traffic,
    histogram,
    connections,
    connectionStep,
    topics,
    publishers,
    latency,
    loss,
    errors,
    health,
    runs,
):
    """
    The whole report as a string.
    """
    window = summary["window_seconds"]
    trafficChart = timeChart(
        "Traffic over time",
        f"per {number(window)} s",
        [
            ("publishes", [(_epoch(r["window_start"]), r["publishes"]) for r in traffic]),
            ("deliveries", [(_epoch(r["window_start"]), r["deliveries"]) for r in traffic]),
        ],
    )
    latencyChart = barChart("Publish-to-ack latency", "acks", histogramBars(histogram))
    connectionChart = timeChart(
        "Concurrent connections",
        "connections",
        [(f"peak per {number(connectionStep)} s", connectionPoints(connections, connectionStep))],
        step=True,
    )
    latencySummary = summary["latency"]
    drops = [
        {"reason": reason, "dropped": count}
        for reason, count in summary["dropped_by_reason"].items()
        if count
    ]
    ends = [
        {"reason": reason, "sessions": count}
        for reason, count in sorted(summary["session_end_reasons"].items())
    ]
    codes = [
        {"code": code, "errors": count} for code, count in sorted(summary["errors_by_code"].items())
    ]
    transports = [
        dict(values, transport=name) for name, values in sorted(summary["transports"].items())
    ]
    unparsed = "".join(
        f"<li><code>{escape(line)}</code></li>" for line in summary["unparsed_examples"]
    )
    lines = summary["lines"]
    sections = [
        "<h1>Dallal broker log report</h1>",
        f"<p>{escape(number(lines['lines']))} lines, "
        f"{escape(summary['first_event_at'] or '–')} to {escape(summary['last_event_at'] or '–')}, "
        f"{summary['runs']} broker start(s); windows of {escape(number(window))} s.</p>",
        figures(summary),
        "<h2>Traffic</h2>",
        trafficChart,
        "<h3>Top topics</h3>",
        table(
            [
                ("topic", "topic"),
                ("publishes", "publishes"),
                ("deliveries", "deliveries"),
                ("redeliveries", "redeliveries"),
                ("bytes_in", "bytes in"),
                ("bytes_out", "bytes out"),
                ("publishers", "publishers"),
                ("subscribers", "subscribers"),
            ],
            topics,
        ),
        "<h3>Top publishers</h3>",
        table(
            [
                ("client", "client"),
                ("run", "run"),
                ("session", "session"),
                ("transport", "transport"),
                ("publishes", "publishes"),
                ("bytes", "bytes"),
                ("topics", "topics"),
            ],
            publishers,
        ),
        "<h3>By transport</h3>",
        table(
            [
                ("transport", "transport"),
                ("sessions", "sessions"),
                ("publishes", "publishes"),
                ("deliveries", "deliveries"),
                ("bytes_in", "bytes in"),
                ("bytes_out", "bytes out"),
            ],
            transports,
        ),
        "<h2>Delivery</h2>",
        f"<p>{number(latencySummary['acks'])} acks: p50 {seconds(latencySummary['p50'])}, "
        f"p95 {seconds(latencySummary['p95'])}, p99 {seconds(latencySummary['p99'])}, "
        f"max {seconds(latencySummary['max'])}; {number(summary['redeliveries'])} redeliveries.</p>",
        latencyChart,
        table(
            [
                ("topic", "topic"),
                ("transport", "transport"),
                ("acks", "acks"),
                ("p50", "p50 (s)"),
                ("p95", "p95 (s)"),
                ("p99", "p99 (s)"),
                ("max", "max (s)"),
            ],
            latency,
        ),
        "<h3>Loss account</h3>",
        accountCheck(summary),
        table([("reason", "drop reason"), ("dropped", "dropped")], drops),
        table(
            [
                ("topic", "topic"),
                ("matched", "matched"),
                ("acked", "acked"),
                ("fired", "fired"),
                ("replaced", "replaced"),
                ("dropped", "dropped"),
                ("inflight", "in flight"),
                ("redeliveries", "redeliveries"),
            ],
            loss,
        ),
        "<h2>Sessions</h2>",
        connectionChart,
        f"<p>Peak: {number(summary['peak_connections'])} connections at "
        f"{escape(summary['peak_connections_at'] or '–')}.</p>",
        table([("reason", "how sessions ended"), ("sessions", "sessions")], ends),
        "<h2>Health</h2>",
        f"<p>{number(summary['pings_missed'])} pings missed, "
        f"{number(summary['clients_dropped'])} clients dropped for missed pings.</p>",
        table([("code", "error code"), ("errors", "errors")], codes),
        table(
            [
                ("client", "client"),
                ("run", "run"),
                ("session", "session"),
                ("code", "code"),
                ("errors", "errors"),
                ("fatal", "fatal"),
            ],
            errors,
        ),
        table(
            [
                ("window_start", "window (UTC)"),
                ("pings_missed", "pings missed"),
                ("clients_dropped", "clients dropped"),
                ("errors", "errors"),
            ],
            health,
        ),
        "<h2>Broker starts</h2>",
        table(
            [
                ("run", "run"),
                ("started", "started (UTC)"),
                ("last_event", "last event (UTC)"),
                ("sessions", "sessions"),
                ("publishes", "publishes"),
            ],
            runs,
        ),
        counterCheck(summary, runs),
        "<h2>Input</h2>",
        table(
            [("kind", "lines"), ("count", "count")],
            [{"kind": kind, "count": lines[kind]} for kind in lines if kind != "lines"],
        ),
        f"<ul>{unparsed}</ul>" if unparsed else "",
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        "<title>Dallal broker log report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n"
    )


def write(path, summary, **rows):
    path.write_text(render(summary, **rows), encoding="utf-8")
