"""The figures of `decodegraph bench ... --plot FILE.png` (matplotlib, an optional extra:
`pip install 'decodegraph[plot]'`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot: matplotlib is not installed; pip install 'decodegraph[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _subtitle(result: dict[str, Any]) -> str:
    m = result["machine"]
    isa = "/".join(m["isa"]) or "no vector ISA found"
    device = m.get("gpu") or f"{m['cpu']} ({isa}), {m['torch_threads']} thread(s)"
    return f"{Path(result['model']).name} - {device} - {result['date'][:10]}"


def _save(fig: Any, path: str) -> None:
    """Write `fig` to `path` and close it (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"saved {out}")


def plot_latency(result: dict[str, Any], path: str) -> None:
    """Output tokens/s against batch size, one line per graph mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    all_sizes: set[int] = set()
    for mode, row in result["results"].items():
        sizes = sorted(int(b) for b in row["batch_sizes"])
        all_sizes.update(sizes)
        rates = [row["batch_sizes"][str(b)]["output_tokens_per_s"] for b in sizes]
        label = mode if row["resolved_mode"] == mode else f"{mode} (ran {row['resolved_mode']})"
        ax.plot(sizes, rates, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(all_sizes), [str(b) for b in sorted(all_sizes)])
    ax.minorticks_off()
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("output tokens/s (median iteration)")
    ax.set_title(
        f"decodegraph bench latency: input {result['input_len']}, output "
        f"{result['output_len']} tokens\n{_subtitle(result)}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_throughput(result: dict[str, Any], path: str) -> None:
    """Output tokens/s per graph mode (bars)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    modes = list(result["results"])
    rates = [result["results"][m]["output_tokens_per_s"] for m in modes]
    ax.bar(modes, rates, color="tab:blue")
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"decodegraph bench throughput: {result['num_prompts']} prompts of "
        f"{result['input_len']} + {result['output_len']} tokens\n{_subtitle(result)}",
        fontsize=10,
    )
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path)


def plot_serve(result: dict[str, Any], path: str) -> None:
    """TTFT and ITL percentiles against request rate."""
    plt = _pyplot()
    runs = result["runs"]
    labels = [str(run["request_rate"]) for run in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        for q in result["metric_percentiles"]:
            values = [run[f"{metric}_ms"]["percentiles"][str(q)] for run in runs]
            ax.plot(labels, values, marker="o", label=f"p{q}")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"decodegraph bench serve: {result['num_prompts']} requests per rate, "
        f"{result['base_url']}\n{_subtitle(result)}",
        fontsize=10,
    )
    _save(fig, path)
