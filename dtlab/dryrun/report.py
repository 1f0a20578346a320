"""One rank's dry-run numbers, and the short table ``dtlab plan --dry-run`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankReport", "format_table"]


@dataclass
class RankReport:
    """One rank: its coordinates, pipeline ``stage`` and ``role`` (first, middle,
    last, only), and two lists of rows ``{category, measured, estimate,
    difference, reason}`` (plus ``published...`` with a stand-in): ``memory``
    (bytes held by category) and ``traffic`` (bytes sent per axis, with ``ops``:
    the measured bytes per op). ``seconds``: its process's time; ``measurement``:
    what :func:`dtlab.dryrun.child.measure_step` returned (bytes by category, and
    by axis, op and tag)."""

    rank: int
    coords: dict
    stage: int
    role: str
    memory: list[dict] = field(default_factory=list)
    traffic: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 1
    measurement: dict = field(default_factory=dict, repr=False)

    def measured(self, kind: str = "memory") -> dict[str, float]:
        """``{category or axis: measured bytes}``."""
        return {r["category"]: r["measured"] for r in getattr(self, kind)}

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "measurement"}
        out["memory_measured"] = self.measurement.get("memory", {})
        return out


def _gb(x) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1e8:
        return f"{x / 1e9:.3f} GB"
    return f"{x:,.0f} B"


def format_table(report) -> str:
    """A short text table: per rank, every category and axis, measured beside the
    estimate, the difference and its reason."""
    pub = report.published is not None
    lines = [
        f"dry run: {report.config.model.n_layers}-layer GPT "
        f"(h={report.config.model.d_model}), layout {report.layout}, "
        f"world {report.world_size}, {report.config.strategy}, "
        f"{report.config.precision}, {report.seconds:.1f} s"
    ]
    head = f"  {'':<12}{'measured':>14}{'estimate':>14}{'difference':>14}"
    if pub:
        head += f"{report.published.name:>16}"
    for r in report.ranks:
        coords = " ".join(f"{a}{r.coords[a]}" for a in ("pp", "dp", "cp", "tp"))
        lines.append(
            f"rank {r.rank} ({coords}; {r.role} stage, {r.seconds:.1f} s, "
            f"{r.steps} step{'s' if r.steps > 1 else ''} run, the last measured)"
        )
        lines.append(head)
        for kind, rows in (("held", r.memory), ("sent", r.traffic)):
            for row in rows:
                if not (row["measured"] or row["estimate"]):
                    continue
                text = (
                    f"  {kind + ' ' + row['category']:<12}{_gb(row['measured']):>14}"
                    f"{_gb(row['estimate']):>14}{_gb(row['difference']):>14}"
                )
                if pub:
                    text += f"{_gb(row.get('published')):>16}"
                lines.append(text)
                ops = row.get("ops")
                if ops:
                    lines.append(
                        "      by op: "
                        + ", ".join(f"{op} {_gb(b)}" for op, b in ops.items() if b)
                    )
                if row["reason"]:
                    lines.append(f"      why: {row['reason']}")
        if pub:
            lines.append(
                f"  {report.published.name} differs: {report.published.reason}"
            )
    return "\n".join(lines)
