"""The tables and plots of an evaluation's results: at a run's end, and from its --json (--report)."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Optional

import cli
from cli import UserError
from evals.journal import batch_entries, journal_path
from evals.runner import Cell, Results, paired_difference, row_cell
from evals.tasks import TASKS
from baselines import QUEST_PAGE
from budgets import Budget
from policies import DENSE, POLICIES, fraction_label, parse_compression


# =============================================================================================
# Reporting
# =============================================================================================


PERCENT_METRICS = ("exact_match", "f1", "recall")  # fractions in the rows, shown in percent (differences in points)
IN_POINTS = f"{', '.join(PERCENT_METRICS[:-1])} and {PERCENT_METRICS[-1]} in points"


def format_cell(metric: str, score: float, stderr: Optional[float]) -> str:
    if stderr is None:
        stderr = math.nan
    if metric in PERCENT_METRICS:
        score, stderr = 100 * score, 100 * stderr
    if metric == "chars":
        text = f"{score:.1f}"
        err = f"{stderr:.1f}"
    elif metric in ("bpc", "answer_nll", "attn_rel_l2", "topk_agreement", "top1_agreement"):
        text, err = f"{score:.3f}", f"{stderr:.3f}"
    else:
        text, err = f"{score:.1f}", f"{stderr:.1f}"
    return text if math.isnan(stderr) else f"{text}±{err}"


def difference_text(metric: str, d: float, se: Optional[float]) -> str:
    """A paired difference and its standard error as the tables show them (fractions in points)."""
    scale = 100 if metric in PERCENT_METRICS else 1
    digits = 1 if metric in PERCENT_METRICS + ("chars",) else 3
    return f"{scale * d:+.{digits}f}" + ("" if se is None else f"±{scale * se:.{digits}f}")


def _index(rows: list[dict]) -> dict[tuple, dict]:
    """(cell, metric, method, target) -> row."""
    return {(row_cell(r), r["metric"], r["attention"], Fraction(r["compression"]).limit_denominator(1 << 16)): r
            for r in rows}


def _cell_heading(cell: Cell, rows: list[dict]) -> str:
    if TASKS[cell.task].size == "tokens":
        return cell.label()
    return f"{cell.label()}, {_mean_tokens(rows, cell):.0f} prompt tokens on average"


OFF_TARGET = 0.2  # a row whose achieved compression is further than this (relative) from its target


def off_target(row: dict) -> bool:
    """The policy could not get near the row's target compression (top-k below 1/2; SparQ at a fixed k
    on short sliding windows): its score is not a comparison at that compression."""
    return abs(row["achieved_compression"] / row["compression"] - 1) > OFF_TARGET


def budget_records(budgets: dict[tuple, Budget]) -> list[dict]:
    """Results.budgets as JSON (the --json's meta, read back by --report)."""
    return [{"task": task, "attention": method, "compression": fraction_label(target), "seq_len": size,
             "r": b.r if b.split is None else b.split[0], "k": b.k_top, "achieved": b.achieved,
             "page_size": b.settings.page_size if _paged(method) else None}
            for (task, method, target, size), b in budgets.items()]


def _paged(method: str) -> bool:
    return method in POLICIES and "page_size" in POLICIES[method].flags


def no_selection(budgets: list[dict], page_size: int = QUEST_PAGE) -> set[tuple]:
    """(task, size, method, compression label) whose budget (the last batch's of that size) leaves nothing
    to select: the transfers went to reading (SparQ's step 1 with r fixed, top-k's all of K, Quest's page
    summaries), leaving k = 1, or for the paged policies (Quest, the hybrid) one page of page_size, the
    newest position's, which they read whatever the query. The cell then scores attention to what the
    policy always reads. On target, so ranked, but not a comparison of how well a method selects. A record's
    own page size (the solver takes larger pages where the default's metadata alone exceeds the target)
    comes before page_size, the run's flag (records written before they carried one)."""
    def floor(b: dict) -> int:
        return (b.get("page_size") or page_size) if _paged(b["attention"]) else 1

    return {(b["task"], b["seq_len"], b["attention"], b["compression"]) for b in budgets
            if b["attention"] != "dense" and b["k"] is not None and b["k"] <= floor(b)}


NO_SELECTION = "‡ = its budget leaves nothing to select (k = 1, or a paged policy's newest page alone: see the budgets)"


def table(rows: list[dict], methods: list[str], targets: list[Fraction], empty: set[tuple] = frozenset()) -> str:
    """One block per task and size: rows = methods; columns = metric x compression, dense in the "1" column.
    empty (no_selection): the cells marked ‡."""
    index = _index(rows)
    shown = [m for m in methods if m != "dense"] or ["dense"]
    sparse_targets = [t for t in targets if t != DENSE]
    lines = []
    for cell in dict.fromkeys(map(row_cell, rows)):
        metrics = [(m, hib) for m, hib in TASKS[cell.task].metrics
                   if any(row_cell(r) == cell and r["metric"] == m for r in rows)]
        header = ["method"]
        columns = []
        for metric, hib in metrics:
            unit = " %" if metric in PERCENT_METRICS else ""
            arrow = "↑" if hib else "↓"
            for t in [DENSE] + sparse_targets:
                header.append(f"{metric}{unit}{arrow} {fraction_label(t)}")
                columns.append((metric, hib, t))
        body = []
        missed = starved = False
        for method in shown:
            cells = [method]
            for metric, hib, t in columns:
                r = index.get((cell, metric, "dense" if t == DENSE else method, t))
                text = format_cell(metric, r["score"], r["stderr"]) if r else "-"
                compressed = bool(r) and t != DENSE
                off = compressed and off_target(r)
                if off:
                    text += "†"
                    missed = True
                if compressed and (cell.task, cell.size, method, fraction_label(t)) in empty:
                    text += "‡"
                    starved = True
                if compressed and not off and len(shown) > 1:  # best among the methods that met the target
                    scores = [index[(cell, metric, m, t)]["score"] for m in shown
                              if (cell, metric, m, t) in index and not off_target(index[(cell, metric, m, t)])]
                    if r["score"] == (max(scores) if hib else min(scores)):
                        text += "*"
                cells.append(text)
            body.append(cells)
        n = {r["n"] for r in rows if row_cell(r) == cell}
        widths = [max(len(str(row[c])) for row in [header] + body) for c in range(len(header))]
        dagger = (f"; † = compression achieved more than {OFF_TARGET:.0%} from its target (the policy cannot "
                  f"reach it here: see the achieved table), not ranked") if missed else ""
        lines.append(f"\n{_cell_heading(cell, rows)} (n = {', '.join(map(str, sorted(n)))} per cell; "
                     f"± = standard error; * = best{dagger}{'; ' + NO_SELECTION if starved else ''})")
        for row in [header] + body:
            lines.append("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def sweeps(rows: list[dict]) -> dict[str, list[Cell]]:
    """The tasks run at more than one size (a length sweep, the paper's Figure 6): task -> its cells by size."""
    cells = sorted(set(map(row_cell, rows)), key=lambda c: c.size)
    by_task = {task: [c for c in cells if c.task == task] for task in dict.fromkeys(r["task"] for r in rows)}
    return {task: cs for task, cs in by_task.items() if len(cs) > 1}


def sweep_table(rows: list[dict], methods: list[str], targets: list[Fraction],
                empty: set[tuple] = frozenset()) -> str:
    """Score against size at each compression, one block per swept task and metric: rows = methods
    (dense first), columns = sizes with their mean prompt tokens; empty: as for table()."""
    index = _index(rows)
    lines = []
    for task, cells in sweeps(rows).items():
        unit = TASKS[task].size
        for metric, hib in TASKS[task].metrics:
            if not any(r["task"] == task and r["metric"] == metric for r in rows):
                continue
            header = ["compression", "method"] + [
                f"{c.size} {unit}" + ("" if unit == "tokens" else f" ({_mean_tokens(rows, c):.0f} tok)") for c in cells]
            body = []
            for t in targets:
                for method in ["dense"] if t == DENSE else [m for m in methods if m != "dense"]:
                    found = [index.get((c, metric, method, t)) for c in cells]
                    if any(found):
                        body.append([fraction_label(t), method] +
                                    [format_cell(metric, r["score"], r["stderr"]) + ("†" if off_target(r) else "")
                                     + ("‡" if (task, c.size, method, fraction_label(t)) in empty else "")
                                     if r else "-" for c, r in zip(cells, found)])
            widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]
            pct = " (%)" if metric in PERCENT_METRICS else ""
            starved = any("‡" in x for row in body for x in row)
            lines.append(f"\n{task} {metric}{pct} against {unit} ({'higher' if hib else 'lower'} is better; "
                         f"† = off its target compression{'; ' + NO_SELECTION if starved else ''})")
            for row in [header] + body:
                lines.append("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _mean_tokens(rows: list[dict], cell: Cell) -> float:
    return next((r["prompt_tokens"] for r in rows if row_cell(r) == cell and r["prompt_tokens"]), float(cell.size))


def aligned(title: str, header: list[str], body: list[list[str]]) -> str:
    """A titled text table: the first two columns (cell and method) left-aligned, the figures right-aligned."""
    widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]
    lines = [f"\n{title}"]
    for row in [header] + body:
        lines.append("  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def delta_table(rows: list[dict], methods: list[str], targets: list[Fraction]) -> str:
    """Paired differences from dense (same examples), per task and size, metric and compression."""
    sparse_targets = [t for t in targets if t != DENSE]
    shown = [m for m in methods if m != "dense"]
    if not sparse_targets or not shown:
        return ""
    index = _index(rows)
    header = ["task/metric", "method"] + [fraction_label(t) for t in sparse_targets]
    body = []
    for cell, metric in dict.fromkeys((row_cell(r), r["metric"]) for r in rows):
        for method in shown:
            cells = []
            for t in sparse_targets:
                r = index.get((cell, metric, method, t))
                if r is None or "delta_vs_dense" not in r:
                    cells.append("-")
                    continue
                cells.append(difference_text(metric, r["delta_vs_dense"], r["delta_stderr"]))
            body.append([f"{cell.label()}/{metric}", method] + cells)
    return aligned(f"paired difference from dense (same examples; {IN_POINTS})", header, body)


def journal_values(path: Path) -> dict[tuple, list[float]]:
    """The per-example values of a --json run, (cell, metric, method, target) -> values in example order,
    from the journal the run keeps beside it (the JSON holds only each cell's mean)."""
    journal = journal_path(path)
    if not journal.is_file():
        raise UserError(f"--versus needs the per-example values in {journal}, the journal a run with --json keeps "
                        f"beside it: it is not there")
    results = Results()
    for entry in batch_entries(journal):
        results.add_record(entry["record"])
    return dict(results.values)


def versus_table(values: dict[tuple, list[float]], methods: list[str], targets: list[Fraction], versus: str) -> str:
    """Paired differences from `versus` (same examples), each policy against it at the same compression
    (against dense at 1): what "level with Quest at 1/8" is judged by."""
    sparse_targets = [t for t in targets if t != DENSE]
    shown = [m for m in methods if m not in ("dense", versus)]
    if not sparse_targets or not shown:
        return ""
    header = ["task/metric", "method"] + [fraction_label(t) for t in sparse_targets]
    body = []
    for cell, metric in dict.fromkeys((cell, metric) for cell, metric, _, _ in values):
        for method in shown:
            cells = []
            for t in sparse_targets:
                mine = values.get((cell, metric, method, t))
                base = values.get((cell, metric, versus, DENSE if versus == "dense" else t))
                if not mine or not base or len(mine) != len(base):
                    cells.append("-")
                    continue
                cells.append(difference_text(metric, *paired_difference(mine, base)))
            body.append([f"{cell.label()}/{metric}", method] + cells)
    return aligned(f"paired difference from {versus} at the same compression (same examples; {IN_POINTS})",
                   header, body)


def against_table(values: dict[tuple, list[float]], other: dict[tuple, list[float]], other_name: str) -> str:
    """Each policy's paired difference from itself in another run (`other`: that run's per-example values),
    at each compression both hold: what a setting that needs a run of its own (a cache format, say) is
    judged by. Pairs need the same examples answered alike by dense, metric by metric: a metric whose dense
    values differ between the runs (other examples, or another machine's rounding, which moves a loss but
    seldom an exact match) is named below the table and not paired; if none pairs, a UserError."""
    header = ["task/metric", "method", "target", "this run", "the other", "difference"]
    body, unpaired = [], []
    for (cell, metric, method, t), mine in values.items():
        theirs = other.get((cell, metric, method, t))
        if method == "dense" or not theirs:
            continue
        dense = (cell, metric, "dense", DENSE)
        if values.get(dense) != other.get(dense) or len(mine) != len(theirs):
            if f"{cell.label()} {metric}" not in unpaired:
                unpaired.append(f"{cell.label()} {metric}")
            continue
        scale = 100 if metric in PERCENT_METRICS else 1
        digits = 1 if metric in PERCENT_METRICS + ("chars",) else 3
        means = [f"{scale * sum(v) / len(v):.{digits}f}" for v in (mine, theirs)]
        body.append([f"{cell.label()}/{metric}", method, fraction_label(t), *means,
                     difference_text(metric, *paired_difference(mine, theirs))])
    if not body and unpaired:
        raise UserError(f"--against {other_name}: dense's {unpaired[0]} values differ from this run's "
                        f"(not the same examples, or another machine's rounding): nothing to pair")
    table = aligned(f"paired difference from {other_name}, policy by policy (same examples; {IN_POINTS})", header,
                    body)
    if unpaired:
        table += f"\nnot paired, dense's values differ between the runs: {', '.join(unpaired)}"
    return table


def achieved_table(rows: list[dict], methods: list[str], targets: list[Fraction]) -> str:
    sparse_targets = [t for t in targets if t != DENSE]
    if not sparse_targets:
        return ""
    lines = ["\nachieved compression (KV transfers / dense, averaged over decode steps and tasks)"]
    width = max(len("method"), *(len(m) for m in methods))
    lines.append(f"{'method':<{width}}  " + "  ".join(f"{fraction_label(t):>7}" for t in sparse_targets))
    for method in methods:
        if method == "dense":
            continue
        cells = []
        for t in sparse_targets:
            vals = [r["achieved_compression"] for r in rows if r["attention"] == method
                    and abs(r["compression"] - float(t)) < 1e-12]
            cells.append(f"{sum(vals) / len(vals):7.3f}" if vals else "      -")
        lines.append(f"{method:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def budget_summary(budgets: dict[tuple, Budget]) -> str:
    """One line per (length, method): the setting chosen for each target and its compression."""
    lines = []
    by_key: dict[tuple[int, str], dict[Fraction, Budget]] = defaultdict(dict)
    for (_, method, target, size), budget in budgets.items():  # size: the task's (tokens, or SQuAD's contexts)
        if method != "dense":
            by_key[(size, method)][target] = budget
    for (_, method), chosen in sorted(by_key.items()):
        parts = []
        for target, b in sorted(chosen.items(), reverse=True):
            if b.split is not None:  # adaptive SparQ's at this length, on a layer that sees all of it
                setting = f"r={b.split[0]}, k={b.split[1]}"
            else:
                setting = f"r={b.r}" if POLICIES[method].knob == "sparq_r" else f"k={b.k_top}"
            parts.append(f"{fraction_label(target)}: {setting} ({b.achieved:.3f})")
        first = next(iter(chosen.values()))
        extra = {"sparq_r": f" (k={first.k_top}, local k/4)", "sparq_k": f" (r={first.r}, local k/4)"}.get(POLICIES[method].knob, "")
        lines.append(f"  S={first.seq_len} {method}{extra}: " + ", ".join(parts))  # the prompt length solved at
    return "budgets (setting: transfers / dense at the prompt length)\n" + "\n".join(lines) if lines else ""


def write_json(path: Path, rows: list[dict], meta: dict, needle_map: Optional[list[dict]] = None) -> None:
    """The results rows and the run's meta; a run with --depths also its needle map (Results.needle_map)."""
    cli.write_json(path, {"results": rows, "meta": meta, **({"needle_map": needle_map} if needle_map else {})})


# =============================================================================================
# The needle map (--task needle --depths): context length against needle depth, per method
# =============================================================================================


def length_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def depth_label(depth: float) -> str:
    return f"{depth:g}%"


def _map_panels(needle_map: list[dict]) -> dict[tuple[str, str], dict[tuple[int, float], dict]]:
    """(method, compression label) -> (length, depth) -> row, dense first, then the methods as run, each
    at its compressions from the largest."""
    panels: dict[tuple[str, str], dict] = {}
    order = {m: i for i, m in enumerate(dict.fromkeys(["dense"] + [r["attention"] for r in needle_map]))}
    for r in sorted(needle_map, key=lambda r: (order[r["attention"]], -r["compression"])):
        panels.setdefault((r["attention"], r["compression_label"]), {})[(r["length"], r["depth"])] = r
    return panels


def _panel_name(method: str, label: str) -> str:
    return "dense" if method == "dense" else f"{method} {label}"


def _found(r: dict, mark: str = "") -> str:
    """+ found in every example, - in none, else k/n; ! when dense found it in an example this one missed,
    followed by the column's mark (needle_map_marks)."""
    k = round(r["exact_match"] * r["n"])
    text = "+" if k == r["n"] else "-" if k == 0 else f"{k}/{r['n']}"
    return text + ("!" + mark if r.get("missed_vs_dense") else "")


MARK_REASONS = {"†": "off its target compression", "‡": "its budget leaves nothing to select"}


def needle_map_marks(rows: list[dict], empty: set[tuple]) -> dict[tuple[str, str, int], str]:
    """(method, compression label, length) -> the needle map column's mark, as table() marks the cell: † off
    its target compression, ‡ nothing left to select (no_selection). Such a column's misses are the
    budget's, not the selector's."""
    marks = {}
    for r in rows:
        if r["task"] != "needle" or r["metric"] != "exact_match" or r["attention"] == "dense":
            continue
        key = (r["attention"], r["compression_label"], r["size"])
        mark = ("†" if off_target(r) else "") + ("‡" if ("needle", r["size"], r["attention"], key[1]) in empty else "")
        if mark:
            marks[key] = mark
    return marks


MAP_MARKS = ", ".join(f"{m} = {why}" for m, why in MARK_REASONS.items()) + " (a column's mark, on its misses)"


def needle_map_table(needle_map: list[dict], width: int = 120,
                     marks: Optional[dict[tuple[str, str, int], str]] = None) -> str:
    """The needle map as text: a block per method and compression (rows = depths, columns = lengths),
    side by side up to `width` characters; then every cell where dense found the needle in an example
    the method missed, named, with its column's mark (needle_map_marks) where the budget explains it."""
    if not needle_map:
        return ""
    marks = marks or {}
    lengths = sorted({r["length"] for r in needle_map})
    depths = sorted({r["depth"] for r in needle_map})
    n = sorted({r["n"] for r in needle_map})
    blocks = []
    for (method, label), cells in _map_panels(needle_map).items():
        header = ["depth"] + [length_label(t) for t in lengths]
        body = [[depth_label(d)] + [_found(cells[(t, d)], marks.get((method, label, t), "")) if (t, d) in cells else "."
                                    for t in lengths] for d in depths]
        widths = [max(len(row[c]) for row in [header] + body) for c in range(len(header))]
        lines = ["  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
                 for row in [header] + body]
        blocks.append([_panel_name(method, label)] + lines)
    out = [f"\nneedle map (rows = needle depth, columns = prompt tokens; n = {', '.join(map(str, n))} per cell): found in "
           f"every example (+),\nin none (-), in k of n (k/n); ! = dense found it in an example this one missed; . = not run"
           + (f";\n{MAP_MARKS}" if marks else "")]
    line: list[list[str]] = []
    for block in blocks + [None]:
        if line and (block is None or sum(max(map(len, b)) + 4 for b in line + [block]) > width):
            widths = [max(map(len, b)) for b in line]
            out.append("")
            out += ["    ".join(b[i].ljust(w) for b, w in zip(line, widths)).rstrip() for i in range(len(line[0]))]
            line = []
        if block is not None:
            line.append(block)
    missed = [r for r in needle_map if r.get("missed_vs_dense")]
    dense = {(r["length"], r["depth"]): r for r in needle_map if r["attention"] == "dense"}
    if not any("missed_vs_dense" in r for r in needle_map if r["attention"] != "dense"):
        return "\n".join(out)
    out.append(f"\ncells where dense finds the needle and a policy misses it (same examples): {len(missed) or 'none'}")
    for r in missed:
        d = dense.get((r["length"], r["depth"]))
        found = lambda row: f"{round(row['exact_match'] * row['n'])}/{row['n']}"
        mark = marks.get((r["attention"], r["compression_label"], r["length"]), "")
        why = "".join(f"; {MARK_REASONS[m]}" for m in mark)
        out.append(f"  {_panel_name(r['attention'], r['compression_label'])} at {length_label(r['length'])} tokens, "
                   f"depth {depth_label(r['depth'])}: missed {r['missed_vs_dense']} that dense found (dense "
                   f"{found(d) if d else '?'}, {r['attention']} {found(r)}{why})")
    return "\n".join(out)


def plot_needle_map(needle_map: list[dict], path: Path, model: str = "",
                    marks: Optional[dict[tuple[str, str, int], str]] = None) -> None:
    """The needle-in-a-haystack picture: a panel per method and compression (dense first), x = prompt
    length, y = needle depth (0% at the top), colour = fraction found (red to green); a cell where
    dense found the needle in an example the method missed is outlined; a column whose budget is off
    target or leaves nothing to select (needle_map_marks) is hatched."""
    marks = marks or {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Rectangle

    panels = _map_panels(needle_map)
    lengths = sorted({r["length"] for r in needle_map})
    depths = sorted({r["depth"] for r in needle_map})
    n = sorted({r["n"] for r in needle_map})
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    w, h = max(2.8, 0.45 * len(lengths) + 1.4), max(2.6, 0.24 * len(depths) + 1.4)
    fig, axes = plt.subplots(nrows, cols, figsize=(w * cols + 1.2, h * nrows + 0.8), squeeze=False,
                             constrained_layout=True)
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgray")  # not run
    image = None
    for index, (ax, ((method, label), cells)) in enumerate(zip(axes.flat, panels.items())):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for (length, depth), r in cells.items():
            y, x = depths.index(depth), lengths.index(length)
            grid[y, x] = r["exact_match"]
            if r.get("missed_vs_dense"):
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2.2))
            if (method, label, length) in marks:
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="///", edgecolor="dimgray",
                                       linewidth=0))
        image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(lengths)), [length_label(t) for t in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [depth_label(d) for d in depths], fontsize=8)
        ax.set_title(_panel_name(method, label), fontsize=10)
        ax.set_xlabel("context length (tokens)", fontsize=8)
        if index % cols == 0:
            ax.set_ylabel("needle depth", fontsize=8)
    empty = list(axes.flat)[len(panels):]
    for ax in empty:
        ax.axis("off")
    if empty:  # the colour bar goes in the grid's first empty slot, not in a column of its own beside it
        fig.colorbar(image, cax=empty[0].inset_axes([0.1, 0.45, 0.8, 0.1]), orientation="horizontal",
                     label="fraction found")
    else:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="fraction found")
    fig.suptitle(f"{model}{': ' if model else ''}needle in a haystack, n = {n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} "
                 f"per cell\noutlined: dense found the needle in an example this method missed"
                 + ("; hatched: the budget is off its target or leaves nothing to select" if marks else ""), fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scores_plot_path(path: Path) -> Path:
    """Where the score plot goes when --plot draws the needle map: beside it, _scores added."""
    return path.with_name(f"{path.stem}_scores{path.suffix}")


def plot(rows: list[dict], path: Path, methods: list[str], model: str = "") -> None:
    """Score against compression per task and metric; for a task run at several sizes, score against
    prompt tokens at each compression instead (the paper's Figure 6); for a metric kept per layer
    (the diagnostics' top-k agreement and attention error), also its value at each layer (Figure 4e).
    Titled with the model and the examples per point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = sweeps(rows)
    panels = []
    for task, metric in dict.fromkeys((r["task"], r["metric"]) for r in rows):
        if task in swept:
            targets = sorted({r["compression"] for r in rows if r["task"] == task and r["compression"] < 1}, reverse=True)
            panels += [(task, metric, t) for t in targets]
        else:
            panels.append((task, metric, None))
            if any(r.get("per_layer") for r in rows if r["task"] == task and r["metric"] == metric):
                panels.append((task, metric, "layers"))
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (task, metric, target) in zip(axes.flat, panels):
        mine = [r for r in rows if r["task"] == task and r["metric"] == metric]
        if target is None:
            _plot_against_compression(ax, mine, methods)
        elif target == "layers":
            _plot_per_layer(ax, mine)
        else:
            _plot_against_length(ax, mine, methods, target)
        hib = dict(TASKS[task].metrics)[metric]
        at = ("" if target is None else " per layer" if target == "layers"
              else f" at {fraction_label(Fraction(target).limit_denominator(1 << 16))}")
        ax.set_title(f"{task}: {metric}{at} ({'higher' if hib else 'lower'} is better)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    n = sorted({r["n"] for r in rows})
    fig.suptitle(f"{model}{', ' if model else ''}n = {n[0] if len(n) == 1 else f'{n[0]}-{n[-1]}'} per point", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_against_compression(ax, rows: list[dict], methods: list[str]) -> None:
    """rows: one task at one size, one metric."""
    dense = [r for r in rows if r["attention"] == "dense"]
    sparse = [m for m in methods if m != "dense"]
    for i, method in enumerate(sparse):
        pts = sorted(((r["achieved_compression"], r["score"], r["stderr"]) for r in rows if r["attention"] == method),
                     key=lambda p: p[:2])
        if dense:
            pts.append((1.0, dense[0]["score"], dense[0]["stderr"]))
        if not pts:
            continue
        x, y, e = zip(*pts)
        shift = 2 ** (0.06 * (i - (len(sparse) - 1) / 2))  # side by side, so error bars stay readable
        e = [v or 0 for v in e]  # no error bar for a single example
        ax.errorbar([v * shift for v in x], y, yerr=e, marker="o", capsize=3, label=method)
    if dense:
        ax.axhline(dense[0]["score"], color="gray", linestyle="--", linewidth=1, label="dense")
    ax.set_xscale("log", base=2)
    # ticks at the powers of 1/2 down to the lowest compression measured (1/8 at least), so no point falls off;
    # a point up to 7% (2^0.1) below a tick, as 1/16's achieved 0.0625 - 1e-5, stays with that tick
    lowest = min([r["achieved_compression"] for r in rows] + [1 / 8])
    ticks = [Fraction(1, 2 ** i) for i in range(math.ceil(-math.log2(lowest) - 0.1) + 1)]
    ax.set_xticks([float(t) for t in ticks], [fraction_label(t) for t in ticks])
    ax.set_xlim(min(ticks) / 1.5, 1.3)
    ax.set_xlabel("compression (KV transfers / dense)")


def _plot_per_layer(ax, rows: list[dict]) -> None:
    """rows: one task at one size, one metric kept per layer; a line per method and compression."""
    for r in sorted((r for r in rows if r.get("per_layer") and r["attention"] != "dense"),
                    key=lambda r: (r["attention"], -r["compression"])):
        ax.plot(range(len(r["per_layer"])), r["per_layer"], marker=".", label=f"{r['attention']} {r['compression_label']}")
    ax.set_xlabel("layer")


def _plot_against_length(ax, rows: list[dict], methods: list[str], target: float) -> None:
    """rows: one task at several sizes, one metric; the methods at compression `target`, dense beside them."""
    shown = ["dense"] + [m for m in methods if m != "dense"]
    ticks = set()
    for i, method in enumerate(shown):
        want = 1.0 if method == "dense" else target
        pts = sorted(((r["prompt_tokens"] or r["size"], r["score"], r["stderr"]) for r in rows
                      if r["attention"] == method and abs(r["compression"] - want) < 1e-12), key=lambda p: p[:2])
        if not pts:
            continue
        x, y, e = zip(*pts)
        ticks.update(x)
        shift = 2 ** (0.03 * (i - (len(shown) - 1) / 2))
        e = [v or 0 for v in e]  # no error bar for a single example
        style = dict(color="gray", linestyle="--") if method == "dense" else {}
        ax.errorbar([v * shift for v in x], y, yerr=e, marker="o", capsize=3, label=method, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [f"{t / 1000:.1f}k" if t >= 1000 else f"{t:.0f}" for t in sorted(ticks)])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens (mean)")


def print_results(rows: list[dict], methods: list[str], targets: list[Fraction], plot_path: Optional[Path],
                  model: str, empty: set[tuple], needle_map: Optional[list[dict]] = None) -> None:
    """The tables (and the plot) of a run's result rows: at its end, or from its --json by --report.
    model: how the plot's title names the run; empty: the cells with no selection (no_selection);
    needle_map (a run with --depths): its table last, and --plot draws it (the score plot goes beside)."""
    print(table(rows, methods, targets, empty))
    if sweeps(rows):
        print(sweep_table(rows, methods, targets, empty))
    print(delta_table(rows, methods, targets))
    print(achieved_table(rows, methods, targets))
    marks = needle_map_marks(rows, empty)
    if needle_map:
        print(needle_map_table(needle_map, marks=marks))
    if plot_path:
        if needle_map:
            plot_needle_map(needle_map, plot_path, model, marks)
            plot(rows, scores_plot_path(plot_path), methods, model)
            print(f"\nplots: {plot_path} (needle map), {scores_plot_path(plot_path)} (scores)")
        else:
            plot(rows, plot_path, methods, model)


def report(paths: list[Path], plot_path: Optional[Path], versus: Optional[str] = None,
           against: Optional[Path] = None) -> int:
    """--report: the tables of --json results files, also of a run still going (it is rewritten after
    every batch), without loading a model. Several files (one run per length, say) are reported as one
    run: they must be of one model and dtype, and a cell two of them hold must hold the same score.
    versus (--versus): a last table of the paired differences from that policy, from the journals.
    against (--against): one of each policy's paired differences from itself in that other run."""
    rows: dict[tuple, dict] = {}
    methods: list[str] = []
    targets: list[Fraction] = []
    empty: set[tuple] = set()
    needle_map: dict[tuple, dict] = {}
    titles = set()
    for path in paths:
        try:  # everything read from the file, so that a file of another shape is one line, not a traceback
            saved = json.loads(path.read_text())
            mine, meta = saved["results"], saved["meta"]
            methods += [m for m in meta["attention"] if m not in methods]
            targets += [t for t in map(parse_compression, meta["compression"]) if t not in targets]
            done = ("complete" if meta.get("complete", True) else
                    f"in progress: {meta['batches_done']} of {meta['batches']} batches")
            replayed = meta.get("batches_from_journal", 0)  # a resumed run timed only its last process
            took = f"{meta['elapsed_s'] / 60:.1f} min" + (f" for the batches after the {replayed} its journal held"
                                                         if replayed else "")
            heading = (f"{path}: model {meta['checkpoint']}, {meta['dtype']}, kernels {meta['kernels']}; "
                       f"{meta['examples']} examples per task and length; {done}; {took}")
            titles.add(plot_title(Path(meta["checkpoint"]), meta["dtype"]))
            empty |= no_selection(meta["budgets"], meta.get("page_size", QUEST_PAGE))
            cells = {(r["task"], r["size"], r["metric"], r["attention"], r["compression"]): r for r in mine}
            map_cells = {(r["length"], r["depth"], r["attention"], r["compression"]): r
                         for r in saved.get("needle_map", [])}
        except FileNotFoundError:
            raise UserError(f"--report {path}: no such file") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--report {path}: not a python -m evals --json results file ({type(e).__name__}: {e})") from None
        if not mine:
            raise UserError(f"--report {path}: no results yet (no batch has finished)")
        if len(titles) > 1:
            raise UserError(f"--report: the files are of different runs' models or dtypes ({', '.join(sorted(titles))})")
        for cell, row in cells.items():
            if cell in rows and (rows[cell]["score"], rows[cell]["n"]) != (row["score"], row["n"]):
                raise UserError(f"--report {path}: {' '.join(map(str, cell))} scores {row['score']:.4g} (n = {row['n']}) "
                                f"here and {rows[cell]['score']:.4g} (n = {rows[cell]['n']}) in an earlier file")
            rows.setdefault(cell, row)
        for cell, row in map_cells.items():
            if cell in needle_map and (needle_map[cell]["exact_match"], needle_map[cell]["n"]) != (row["exact_match"], row["n"]):
                raise UserError(f"--report {path}: the needle map's {row['attention']} {row['compression_label']} at "
                                f"{row['length']} tokens, depth {depth_label(row['depth'])} differs from an earlier file's")
            needle_map.setdefault(cell, row)
        print(heading)
    values: dict[tuple, list[float]] = {}
    if versus is not None and versus not in methods:
        raise UserError(f"--versus {versus}: the files ran no {versus} (they ran {', '.join(methods)})")
    if versus is not None or against is not None:  # read before anything prints: a missing journal is one line
        for path in paths:  # a cell two files hold is the same run's (checked above): the first one's
            for key, mine in journal_values(path).items():
                values.setdefault(key, mine)
    paired_with_other = against_table(values, journal_values(against), str(against)) if against is not None else ""
    print_results(list(rows.values()), methods, targets, plot_path, titles.pop(), empty, list(needle_map.values()))
    if versus is not None:
        print(versus_table(values, methods, targets, versus))
    if against is not None:
        print(paired_with_other)
    return 0


def plot_title(checkpoint: Path, dtype: str) -> str:
    """How a plot names its run (a run's end and --report alike)."""
    return f"{checkpoint.name} ({dtype})"
