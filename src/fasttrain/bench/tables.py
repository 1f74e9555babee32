"""The shared pieces of every suite's Markdown: numbers as text, a table, the header of a result
(command, data, setting, machine, software, run), the list of rows not run, the image links.

Each suite's report (``fasttrain.bench.suites.<name>``) lays its own tables out with these.
"""

from __future__ import annotations

from fasttrain.bench.results import NOT_SELECTED, CaseResult, SuiteResult
from fasttrain.bench.suite import Images, Suite


def fmt_num(value: float | None, digits: int = 3) -> str:
    """Three significant digits, thousands separated: 12,500 · 38.2 · 5.23 · 0.412."""
    if value is None:
        return "-"
    if abs(value) >= 10 ** digits:
        return f"{value:,.0f}"
    text = f"{value:.{digits}g}"
    if "e" in text:
        return f"{value:.2e}"
    return text


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{fmt_num(value)}×"


def baseline_labels(result: SuiteResult, suite: Suite | None = None) -> list[str]:
    """The rows the speed-up columns divide by: as recorded, else as ``suite`` (defined today) names them."""
    if result.baselines:
        return list(result.baselines)
    return suite.baselines() if suite is not None else []


def baseline_case(result: SuiteResult, case: CaseResult, suite: Suite | None = None) -> CaseResult | None:
    """The baseline row that ran on ``case``'s model, in its precision where there is one."""
    labels = baseline_labels(result, suite)
    same_model = [c for c in result.ran() if c.label in labels and c.model == case.model]
    return next((c for c in same_model if c.precision == case.precision), same_model[0] if same_model else None)


def environment_of(case: CaseResult) -> dict:
    """The machine and libraries the case's first run recorded ({} for a case that did not run)."""
    return case.records[0]["environment"] if case.records else {}


def gpu_name(env: dict) -> str:
    gpu = env.get("gpu")
    return gpu["name"] if gpu else "none"


def versions(env: dict) -> str:
    return "; ".join(f"{k}={v}" for k, v in sorted((env.get("libraries") or {}).items()))


def machine_line(env: dict) -> str:
    gpu = env.get("gpu")
    cpu = f"{env.get('cpu', '?')} ({env.get('cores', '?')} cores)"
    if gpu:
        return (f"{gpu['name']} (driver {gpu['driver']}, {gpu['memory_mib']} MiB, max clocks SM {gpu['max_sm_clock_mhz']} MHz"
                f" / memory {gpu['max_mem_clock_mhz']} MHz); host CPU {cpu}")
    return f"no GPU; CPU {cpu}"


def dataset_line(dataset: dict) -> str:
    text = f"{dataset['name']} ({dataset['n_train']:,} train / {dataset['n_test']:,} test examples)"
    if dataset.get("synthetic"):
        text += ", SYNTHETIC data (no MNIST found): timings are valid, accuracies mean nothing"
    elif dataset.get("subset"):
        text += ", the first examples of each split (--quick)"
    return text


def table(header: list[str], rows: list[list[str]], align: str) -> str:
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def config_line(result: SuiteResult) -> str:
    case = next(iter(result.ran()), None) or next(iter(result.cases), None)
    if case is None:
        return ""
    if case.k is not None:   # the many suite: each model's length and batch head its own tables
        return (f"K = n × n models per case (n learning rates around each model's default × n seeds), "
                f"{plural(result.repeats, 'repeat')} (repeat r: seeds r·n .. r·n + n − 1)")
    seeds = f"seeds 0..{result.repeats - 1}" if result.repeats > 1 else "seed 0"

    def setting(cfg: dict) -> str:
        length = plural(cfg["epochs"], "epoch") if cfg.get("steps") is None else plural(cfg["steps"], "step")
        return f"{length}, batch {cfg['batch_size']}, lr {cfg['lr']}"

    # a suite of several workloads (record, peers) gives each model its own length, batch and lr
    per_model = {c.model: setting(c.config) for c in (result.ran() or result.cases)}
    if len(set(per_model.values())) > 1:
        return "; ".join(f"{m}: {v}" for m, v in per_model.items()) + f"; {seeds}"
    return f"{setting(case.config)}, {seeds}"


def git_line(result: SuiteResult) -> str:
    """The commit the rows ran at; for a merged result whose parts ran at several, each with what ran there:
    its models or its rows, whichever list is shorter."""
    def grouped(key) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for case in result.ran():
            sha = (environment_of(case).get("git_sha") or "")[:7]
            if sha and key(case) not in out.setdefault(sha, []):
                out[sha].append(key(case))
        return out

    by_model, by_row = grouped(lambda c: c.model), grouped(lambda c: c.label)
    if len(by_model) <= 1:
        return result.environment.get("git_sha") or next(iter(by_model), "?")
    best = min((by_model, by_row), key=lambda g: sum(len(v) for v in g.values()))
    return ", ".join(f"{sha} ({', '.join(names)})" for sha, names in best.items())


def header(result: SuiteResult) -> str:
    env = result.environment
    lines = [
        *(f"- Command: `{c}`" for c in (result.commands or [result.command]) if c),
        f"- Data: {dataset_line(result.dataset)}",
        f"- Setting: {config_line(result)}",
        f"- Machine: {machine_line(env)}",
        f"- Software: Python {env.get('python', '?')}; {versions(env)}; git {git_line(result)}",
        f"- Run: {result.timestamp}" + (" (**--quick**: a short smoke run, not the benchmark protocol)" if result.quick else ""),
    ]
    return "\n".join(line for line in lines if line)


def skipped_list(result: SuiteResult) -> str:
    """Skipped and failed rows, grouped by engine and reason so the list stays short."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for case in result.cases:
        if case.ok or case.reason == NOT_SELECTED:
            continue
        groups.setdefault((case.status, case.engine, case.reason or ""), []).append(case.label)
    lines = []
    for (status, engine, reason), labels in groups.items():
        names = ", ".join(dict.fromkeys(labels))
        word = "FAILED" if status == "failed" else "not run"
        lines.append(f"- {word}: {names}: {reason}")
    return "\n".join(lines)


def image_links(images: Images) -> list[str]:
    return [" ".join(f"![{alt}]({path})" for alt, path in images)] if images else []
