"""Fit STS temperatures for a DSpark drafter from recorded verify outcomes.

    python -m training.calibrate_sts SHARD_OR_DIR [...] --dataset NAME --out sts.json [--plot sts.png]
    python -m training.calibrate_sts HELDOUT_SHARDS --apply sts.json --dataset NAME --out report.json

Each shard is an .npz holding the raw confidence logits `logits` [n, γ] (collected with identity
temperatures, in a verify mode that scores the whole block: static or cap-accept) and either
prefix-survival labels `prefix_mask` [n, γ] or accepted-draft counts `num_accepted_drafts` [n]
(aliases: see LOGITS_KEYS, LABEL_KEYS, COUNT_KEYS).  A directory argument means every *.npz in it.

Writes the calibration JSON (temperatures plus per-position ECE/AUROC/Brier of the cumulative
survival before, i.e. at identity temperatures, and after) and a reliability plot PNG.  Shards
that say which group (workload) each row came from also get ``by_group``: ECE before / after and
mean survival vs mean label per group and position; shards that flag each request's final round
get the same for final vs earlier rounds (``by_round``).

``--apply sts.json`` fits nothing: it scores a calibration fitted elsewhere on these shards (a
recording of held-out prompts), so "ECE after" is the held-out ECE of that file's temperatures,
pooled over workloads like the fit's own figures; the report JSON carries the same keys.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from dspark_jax.calibration import (
    DEFAULT_ECE_BINS,
    StsCalibration,
    check_prefix_labels,
    confidence_metrics_by_position,
    fit_sts,
    prefix_labels_from_accept_counts,
    reliability_table,
    temperature_grid,
)

LOGITS_KEYS = ("logits", "confidence_logits")
LABEL_KEYS = ("prefix_mask", "prefix_labels")
COUNT_KEYS = ("num_accepted_drafts", "num_correct_drafts")


def _first_key(shard, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if k in shard.files), None)


def load_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(logits [n, γ] float64, prefix labels [n, γ] int8) from one recorder shard."""
    with np.load(path) as shard:
        logits_key, label_key, count_key = (_first_key(shard, k) for k in (LOGITS_KEYS, LABEL_KEYS, COUNT_KEYS))
        if logits_key is None or (label_key is None and count_key is None):
            raise ValueError(f"{path}: needs one of {LOGITS_KEYS} and one of {LABEL_KEYS + COUNT_KEYS}; "
                             f"has {shard.files}")
        logits = np.asarray(shard[logits_key], dtype=np.float64)
        if logits.ndim != 2:
            raise ValueError(f"{path}: {logits_key} must be [n, block_size]; got shape {logits.shape}")
        try:
            labels = check_prefix_labels(shard[label_key], logits.shape[1]) if label_key else None
            from_counts = prefix_labels_from_accept_counts(shard[count_key], logits.shape[1]) if count_key else None
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
    if labels is not None and from_counts is not None and not np.array_equal(labels, from_counts):
        raise ValueError(f"{path}: {label_key} disagrees with {count_key}")
    labels = labels if labels is not None else from_counts
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"{path}: {logits.shape[0]} rows of logits but {labels.shape[0]} rows of labels")
    return logits, labels


def shard_paths(inputs: list[str]) -> list[Path]:
    paths = []
    for item in map(Path, inputs):
        found = sorted(item.glob("*.npz")) if item.is_dir() else [item]
        if not found or not all(p.is_file() for p in found):
            raise FileNotFoundError(f"{item}: no .npz shard(s) there")
        paths += found
    return paths


def load_shards(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    pairs = [load_shard(p) for p in paths]
    block_sizes = {logits.shape[1] for logits, _ in pairs}
    if len(block_sizes) != 1:
        raise ValueError(f"shards disagree on block size: {sorted(block_sizes)}")
    logits = np.concatenate([lg for lg, _ in pairs])
    if logits.shape[0] == 0:
        raise ValueError("the shards hold no samples")
    return logits, np.concatenate([lb for _, lb in pairs])


def _optional_rows(paths: list[Path], keys: tuple[str, ...], read) -> np.ndarray | None:
    """``read(shard)`` of every shard, concatenated in ``load_shards`` row order; None unless every
    shard holds all of ``keys`` (older shards carry only logits and labels)."""
    parts = []
    for path in paths:
        with np.load(path) as shard:
            if any(k not in shard.files for k in keys):
                return None
            parts.append(read(shard))
    return np.concatenate(parts) if parts else None


def load_groups(paths: list[Path]) -> np.ndarray | None:
    """Each row's group name (``group_names[group_ids]``, written by the recorder), in the row order
    of ``load_shards``; None unless every shard carries groups and some row has a non-empty name."""
    names = _optional_rows(paths, ("group_ids", "group_names"),
                           lambda shard: np.asarray(shard["group_names"]).astype(str)[shard["group_ids"]])
    return names if names is not None and (names != "").any() else None


def load_final_rounds(paths: list[Path]) -> np.ndarray | None:
    """Each row's ``final_round`` flag (the request finished in that round), in ``load_shards``
    row order; None unless every shard carries the flag."""
    return _optional_rows(paths, ("final_round",), lambda shard: np.asarray(shard["final_round"], bool))


def metrics_by_group(groups: np.ndarray, before: np.ndarray, after: np.ndarray, labels: np.ndarray,
                     num_bins: int) -> dict:
    """Per group: rows, per-position ECE of the survival before / after, mean survival after and mean
    label.  A shared temperature cannot remove a bias whose sign differs between groups; this
    shows whether that is what the pooled ECE after the fit is made of."""
    out = {}
    for name in sorted(set(groups.tolist())):
        rows = groups == name
        b = confidence_metrics_by_position(before[rows], labels[rows], num_bins)
        a = confidence_metrics_by_position(after[rows], labels[rows], num_bins)
        out[name] = {"num_samples": int(rows.sum()), "ece_before": _json_floats(b["ece"]),
                     "ece_after": _json_floats(a["ece"]), "mean_survival_after": _json_floats(after[rows].mean(0)),
                     "mean_label": _json_floats(labels[rows].mean(0))}
    return out


def _json_floats(values) -> list[float | None]:
    """Floats for JSON; NaN (e.g. AUROC where every label is equal) becomes null."""
    return [None if math.isnan(v) else round(float(v), 6) for v in values]


def plot_reliability(path: Path, before: np.ndarray, after: np.ndarray, labels: np.ndarray,
                     num_bins: int, title: str) -> None:
    """One reliability panel per block position: cumulative survival before vs after STS."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    block_size = labels.shape[1]
    cols = min(block_size, 4)
    rows = math.ceil(block_size / cols)
    fig = Figure(figsize=(3.2 * cols, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for k, ax in enumerate(axes):
        if k >= block_size:
            ax.set_visible(False)
            continue
        ax.plot([0, 1], [0, 1], color="0.6", linestyle=":", linewidth=1)
        for name, survival, color in (("before", before, "tab:red"), ("after", after, "tab:blue")):
            table = reliability_table(survival[:, k], labels[:, k], num_bins)
            filled = table.count > 0
            ax.plot(table.mean_prediction[filled], table.mean_label[filled], marker="o", markersize=3,
                    color=color, label=f"{name}: ECE {table.ece:.3f}")
        ax.set(xlim=(0, 1), ylim=(0, 1), title=f"position {k + 1}", xlabel="predicted survival",
               ylabel="accepted fraction")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.calibrate_sts", description=__doc__.split("\n\n")[0])
    p.add_argument("shards", nargs="+", help=".npz shard files or directories of them")
    p.add_argument("--dataset", required=True, help="name of the held-out data the shards came from (recorded)")
    p.add_argument("--out", required=True, type=Path, help="calibration JSON to write")
    p.add_argument("--plot", type=Path, help="reliability PNG (default: --out with .png suffix)")
    p.add_argument("--block-size", type=int, help="fail unless the shards have this block size")
    p.add_argument("--bins", type=int, default=DEFAULT_ECE_BINS, help="ECE bins (default 15, as SGLang)")
    p.add_argument("--grid-min", type=float, default=0.1)
    p.add_argument("--grid-max", type=float, default=10.0)
    p.add_argument("--grid-size", type=int, default=41)
    p.add_argument("--apply", type=Path, help="score this calibration file on the shards instead of fitting one")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = shard_paths(args.shards)
    logits, labels = load_shards(paths)
    groups = load_groups(paths)
    final = load_final_rounds(paths)
    n, block_size = logits.shape
    if args.block_size is not None and block_size != args.block_size:
        raise SystemExit(f"shards have block size {block_size}, expected {args.block_size}")

    if args.apply is not None:
        calibration, at_grid_edge = StsCalibration.load(args.apply, block_size), []
    else:
        grid = temperature_grid(args.grid_min, args.grid_max, args.grid_size)
        fit = fit_sts(logits, labels, grid=grid, num_bins=args.bins)
        calibration, at_grid_edge = fit.calibration, fit.at_grid_edge
    before_survival = StsCalibration.identity(block_size).survival(logits)
    after_survival = calibration.survival(logits)
    before = confidence_metrics_by_position(before_survival, labels, args.bins)
    after = confidence_metrics_by_position(after_survival, labels, args.bins)

    record = {
        "block_size": block_size,
        "num_samples": n,
        "dataset": args.dataset,
        **({"applied": str(args.apply)} if args.apply is not None else
           {"grid": {"min": args.grid_min, "max": args.grid_max, "num": args.grid_size, "spacing": "log"}}),
        "ece_bins": args.bins,
        **{f"{metric}_{when}": _json_floats(values[metric])
           for metric in ("ece", "auroc", "brier") for when, values in (("before", before), ("after", after))},
        "mean_label": _json_floats(before["mean_label"]),
    }
    if groups is not None:
        record["by_group"] = metrics_by_group(groups, before_survival, after_survival, labels, args.bins)
    if final is not None and final.any():
        # A request's last round: a block that runs past its EOS holds positions the drafter
        # never trained on, and the request commits nothing after the EOS.
        record["by_round"] = metrics_by_group(np.where(final, "final", "earlier"), before_survival,
                                              after_survival, labels, args.bins)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    calibration.save(args.out, record)
    plot_path = args.plot or args.out.with_suffix(".png")
    what = f"{args.apply.name} applied to" if args.apply is not None else "STS fitted on"
    plot_reliability(plot_path, before_survival, after_survival, labels, args.bins,
                     f"{what}: {args.dataset} (n={n})")

    print(f"{n} samples, block size {block_size} -> {args.out}, {plot_path}" + (f" ({what} them)"))
    print(" pos      T   ECE before  ECE after  AUROC  Brier before/after")
    for k, t in enumerate(calibration.temperatures):
        print(f"{k + 1:4d} {t:6.3f}   {before['ece'][k]:9.4f}  {after['ece'][k]:9.4f}  {after['auroc'][k]:5.3f}"
              f"  {before['brier'][k]:.4f}/{after['brier'][k]:.4f}")
    for name, g in [*record.get("by_group", {}).items(), *record.get("by_round", {}).items()]:
        bias = [s - y for s, y in zip(g["mean_survival_after"], g["mean_label"])]
        print(f"group {name!r} (n={g['num_samples']}): ECE after " + " ".join(f"{e:.3f}" for e in g["ece_after"])
              + " | mean survival - mean label " + " ".join(f"{b:+.3f}" for b in bias))
    if at_grid_edge:
        print(f"warning: positions {[k + 1 for k in at_grid_edge]} chose a grid-edge temperature; "
              f"consider widening --grid-min/--grid-max", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
