"""Aggregation cost of each server rule: time and peak memory as ratios to a plain numpy weighted sum.

    python -m benchmarks.aggregation                       # every registered rule, 10 clients x {1M, 10M} params
    python -m benchmarks.aggregation --sizes 100000 --repeats 3 --rules fedavg fedadam

For every model size the script builds one global model (four float32 tensors and an int64 counter, like a small
network with a BatchNorm counter) and ``--clients`` client models around it, then measures, in the same process:

- the baseline: ``sum_i w_i * y_i`` key by key in float32, in place (one product temporary per client), the least
  a weighted average can cost in numpy;
- each rule's ``aggregate`` on a second round (so FedOpt moments and FedAdp angles exist), its median wall time over
  ``--repeats`` runs alternating with the baseline, and its peak of newly allocated memory (``tracemalloc``, which
  numpy reports to) in a separate run so that tracing does not distort the timing.

Time ratios are rule / the baseline timed alternately with it (a busy machine slows both alike); the load average
is printed with the table. Memory ratios are rule / baseline. "peak / model" is the peak over the size of one
model: it stays a small constant for rules that stream over clients (memory O(model)) and would grow with the
number of clients otherwise. The client models themselves exist before the call and are not counted. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.registry import RULES, build_rule
from aggregators.types import ClientUpdate, RoundContext

#: Every registered rule (``aggregators.registry.RULES``), in name order: a new rule is measured without being
#: listed here.
DEFAULT_RULES = tuple(sorted(RULES))
#: Arguments a rule cannot be built without (attack_adaptive's shipped attention network fits LeNet-5 only).
RULE_ARGS = {"attack_adaptive": {"allow_random_attention": True}}
#: How a client reports each meta key a rule requires, given the trainable keys and the global model; the values
#: do not change a rule's cost. A rule that requires another key stops the benchmark by name (`rule_meta`).
META_FOR_KEY = {
    meta_keys.SCAFFOLD_CTRL_DIFF: lambda keys, model: {k: np.zeros_like(model[k]) for k in keys},
    meta_keys.FEDDYN_ALPHA_K: lambda keys, model: 0.01,
    meta_keys.FEDDYN_PARAM_KEYS: lambda keys, model: list(keys),
}
LAYER_SHARES = (0.55, 0.3, 0.1, 0.05)


def make_model(num_params: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A global model of about ``num_params`` float32 parameters in four tensors, plus an int64 buffer."""
    rng = np.random.default_rng(seed)
    sizes = [max(1, int(num_params * share)) for share in LAYER_SHARES]
    model = {f"layer{i}.weight": rng.standard_normal(size, dtype=np.float32) for i, size in enumerate(sizes)}
    model["bn.num_batches_tracked"] = np.array(100, dtype=np.int64)
    return model


def make_updates(global_params: Mapping[str, np.ndarray], num_clients: int, seed: int = 1) -> list[ClientUpdate]:
    """Client models = global + small noise, with the meta every rule here needs (FedNova's tau and ||a||_1)."""
    rng = np.random.default_rng(seed)
    trainable = [k for k, v in global_params.items() if np.issubdtype(v.dtype, np.floating)]
    updates = []
    for i in range(num_clients):
        params = {
            k: (v + np.float32(0.01) * rng.standard_normal(v.shape, dtype=np.float32)) if k in trainable else v + 5
            for k, v in global_params.items()
        }
        meta = {meta_keys.PARAM_KEYS: trainable, meta_keys.FEDNOVA_TAU: 10 + i, meta_keys.FEDNOVA_A_NORM: 10.0 + i}
        updates.append(ClientUpdate(site=f"site-{i + 1:02d}", params=params, num_samples=100 + 10 * i, meta=meta))
    return updates


def weighted_sum_baseline(updates: Sequence[ClientUpdate], weights: np.ndarray) -> dict[str, np.ndarray]:
    """The plain numpy weighted sum the rules are compared with (float32, in place)."""
    result = {}
    for key in updates[0].params:
        total = np.float32(weights[0]) * updates[0].params[key]
        for weight, update in zip(weights[1:], updates[1:], strict=True):
            total += np.float32(weight) * update.params[key]
        result[key] = total
    return result


def seconds(call: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def interleaved_medians(call: Callable[[], Any], baseline: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median wall times of ``call`` and ``baseline`` run alternately, so a busy machine slows both alike."""
    pairs = [(seconds(call), seconds(baseline)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def peak_bytes(call: Callable[[], Any]) -> int:
    """Peak memory allocated during ``call`` (the result included), beyond what existed before."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        result = call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del result
    return peak - before


def rule_meta(rule: Any, global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate]) -> dict[str, Any]:
    """The meta ``rule`` requires beyond what `make_updates` sends, the same for every client."""
    missing = [key for key in rule.required_meta if key not in META_FOR_KEY and key not in updates[0].meta]
    if missing:
        raise SystemExit(f"rule '{rule.name}' requires {missing}: teach META_FOR_KEY how a client reports it")
    keys = updates[0].meta[meta_keys.PARAM_KEYS]
    return {k: META_FOR_KEY[k](keys, global_params) for k in rule.required_meta if k in META_FOR_KEY}


def rule_call(name: str, global_params: dict[str, np.ndarray], updates: list[ClientUpdate]) -> Callable[[], Any]:
    """A zero-argument call of the rule's second-round aggregation (state from a first round)."""
    rule = build_rule(name, **RULE_ARGS.get(name, {}))
    extra = rule_meta(rule, global_params, updates)
    updates = [ClientUpdate(u.site, u.params, u.num_samples, {**u.meta, **extra}) for u in updates]
    population = tuple(u.site for u in updates)
    first = rule.aggregate(global_params, updates, rule.init_state(global_params), RoundContext(0, 2, population))
    context = RoundContext(1, 2, population)
    return lambda: rule.aggregate(global_params, updates, first.state, context)


def measure(num_params: int, num_clients: int, rules: Sequence[str], repeats: int) -> list[dict[str, Any]]:
    global_params = make_model(num_params)
    updates = make_updates(global_params, num_clients)
    counts = np.array([u.num_samples for u in updates], dtype=np.float64)
    weights = counts / counts.sum()
    model_bytes = sum(v.nbytes for v in global_params.values())
    baseline = lambda: weighted_sum_baseline(updates, weights)  # noqa: E731
    base_time, base_peak = interleaved_medians(baseline, baseline, repeats)[0], peak_bytes(baseline)
    rows = [_row("numpy weighted sum", num_params, base_time, base_peak, base_time, base_peak, model_bytes)]
    for name in rules:
        call = rule_call(name, global_params, updates)
        rule_time, local_base = interleaved_medians(call, baseline, repeats)
        row = _row(name, num_params, rule_time, peak_bytes(call), local_base, base_peak, model_bytes)
        rows.append(row)
    return rows


def _row(rule, num_params, seconds, peak, base_seconds, base_peak, model_bytes) -> dict[str, Any]:
    return {
        "params": num_params,
        "rule": rule,
        "ms": seconds * 1e3,
        "time_ratio": seconds / base_seconds,
        "peak_mib": peak / 2**20,
        "peak_ratio": peak / base_peak,
        "peak_per_model": peak / model_bytes,
    }


def markdown(rows: Sequence[Mapping[str, Any]], num_clients: int) -> str:
    lines = [
        f"| params | rule ({num_clients} clients) | time (ms) | time / numpy | peak (MiB) | peak / numpy "
        "| peak / model |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params']:,} | {r['rule']} | {r['ms']:.1f} | {r['time_ratio']:.2f} | {r['peak_mib']:.1f} | "
            f"{r['peak_ratio']:.2f} | {r['peak_per_model']:.2f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.aggregation", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="parameters per model")
    parser.add_argument("--clients", type=int, default=10, help="client models per round (default: 10)")
    parser.add_argument(
        "--rules",
        nargs="+",
        default=list(DEFAULT_RULES),
        choices=DEFAULT_RULES,
        metavar="RULE",
        help="registered rule names (default: all of them, %(default)s)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per rule; the median is reported")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = [row for size in args.sizes for row in measure(size, args.clients, args.rules, args.repeats)]
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"{os.cpu_count()} CPUs, load average {load} (1, 5, 15 min) at the end\n")
    print(markdown(rows, args.clients))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
