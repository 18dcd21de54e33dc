"""Run one Vidur 0.0.26 simulation and print one JSON line (simulation speed).

Meant to be run with the separate virtualenv, never with the project's .venv:

    .vidur-venv/bin/python benchmarks/vidur_run.py --requests 2000 --qps 20 \
        --replicas 1 --prefill-tokens 512 --decode-tokens 128 --seed 0

What is simulated: meta-llama/Llama-3-8B (Vidur's built-in model config),
device h100 on an h100_dgx node, TP=1/PP=1 per replica, Vidur's vLLM replica
scheduler, round-robin global scheduler, synthetic requests with Poisson
arrivals at --qps and fixed prefill/decode lengths.

Profiling data: the vidur wheel and sdist on PyPI ship NO profiling data.
Vidur 0.0.26 downloads it at run time from HuggingFace datasets
(project-vajra/dev-staging-meta-llama-llama-3-8b-h100 and
project-vajra/dev-staging-h100-dgx), which cannot be reached from here.  This
script therefore writes a *synthetic* H100 profile for Llama-3-8B (roofline
model: GEMMs at 600 TFLOP/s, attention at 400 TFLOP/s, 2.6 TB/s HBM, small
fixed kernel overheads) in exactly the CSV schema Vidur's profiler produces,
and points Vidur's predictor at it.  Everything after that (random-forest
training, the prediction tables, the discrete-event simulation, the vLLM
scheduler, metrics) is stock Vidur code.  The simulated latencies are
therefore only roughly H100-like; simulation *speed* does not depend on the
exact numbers beyond how they shape batching.

Timing:
  setup_s  building the execution-time predictor: with a cold cache this
           writes the synthetic profile, trains the random forests and
           predicts+caches the lookup tables; with a warm cache it loads the
           cached tables (.csv.xz).  Done before any simulation timer.
  init_s   Simulator() construction: request generation, cluster/scheduler
           setup (the predictor built above is reused, not rebuilt).
  wall_s   Simulator.run() event loop, incl. Vidur's in-memory metric
           collection; output writing (CSVs/plots/traces) is skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vidur_profile import (  # beside this script: it runs as one, in Vidur's venv
    DEVICE,
    MODEL_NAME,
    NETWORK_DEVICE,
    NETWORK_PROFILE_NAME,
    PROFILE_NAME,
    write_synthetic_profile,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = ROOT / ".vidur-venv" / "vidur_cache"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, required=True)
    p.add_argument(
        "--qps", type=float, required=True, help="Poisson arrival rate for the whole cluster"
    )
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--prefill-tokens", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--global-scheduler", default="round_robin", choices=["round_robin", "lor", "random"]
    )
    p.add_argument(
        "--batch-size-cap",
        type=int,
        default=128,
        help="vLLM max running requests per replica (vidur default 128)",
    )
    p.add_argument(
        "--max-tokens-in-batch",
        type=int,
        default=None,
        help="vLLM max batched tokens (default max(4096, prefill))",
    )
    p.add_argument(
        "--native-predictor",
        action="store_true",
        help="use vidur's C++ execution-time lookup (default: python)",
    )
    p.add_argument(
        "--cache-dir",
        default=str(DEFAULT_CACHE_DIR),
        help="profile + predictor cache (default: .vidur-venv/vidur_cache)",
    )
    p.add_argument(
        "--rf-estimators",
        type=int,
        default=50,
        help="random-forest trees (vidur default grid: 250/500/750)",
    )
    p.add_argument("--rf-max-depth", type=int, default=16)
    p.add_argument(
        "--setup-only", action="store_true", help="only build/cache the predictor, then exit"
    )
    p.add_argument("--verbose", action="store_true", help="vidur INFO logs on stderr")
    return p.parse_args(argv)


# --------------------------------------------------------------------------
# vidur glue
# --------------------------------------------------------------------------


class _DropHfNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load predictions from HF" not in record.getMessage()


def _quiet_vidur_logging(verbose: bool) -> None:
    lg = logging.getLogger("vidur")
    for h in list(lg.handlers):
        lg.removeHandler(h)
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.INFO if verbose else logging.WARNING)
    h.addFilter(_DropHfNoise())
    h.setFormatter(logging.Formatter("vidur %(levelname)s %(name)s: %(message)s"))
    lg.addHandler(h)


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def build_config(args, output_dir: str):
    from vidur.config import (
        CacheConfig,
        ClusterConfig,
        FixedRequestLengthGeneratorConfig,
        LORGlobalSchedulerConfig,
        MetricsConfig,
        PoissonRequestIntervalGeneratorConfig,
        RandomForrestExecutionTimePredictorConfig,
        RandomGlobalSchedulerConfig,
        ReplicaConfig,
        RoundRobinGlobalSchedulerConfig,
        SimulationConfig,
        SyntheticRequestGeneratorConfig,
        VllmSchedulerConfig,
    )

    p, d = args.prefill_tokens, args.decode_tokens
    max_tokens_in_batch = args.max_tokens_in_batch or max(4096, p)
    request_max_tokens = max(4096, p + d)
    # Size of vidur's precomputed lookup tables (part of the cache key); a power
    # of two >= 8192 so that most workloads share one cache.
    pred_max_tokens = max(8192, _pow2_at_least(p + d + 256), _pow2_at_least(max_tokens_in_batch))

    global_sched = {
        "round_robin": RoundRobinGlobalSchedulerConfig,
        "lor": LORGlobalSchedulerConfig,
        "random": RandomGlobalSchedulerConfig,
    }[args.global_scheduler]()

    cluster = ClusterConfig(
        num_replicas=args.replicas,
        replica_config=ReplicaConfig(
            model_name=MODEL_NAME,
            device=DEVICE,
            network_device=NETWORK_DEVICE,
            tensor_parallel_size=1,
            num_pipeline_stages=1,
        ),
        cache_config=CacheConfig(),
        global_scheduler_config=global_sched,
        replica_scheduler_config=VllmSchedulerConfig(
            batch_size_cap=args.batch_size_cap,
            max_tokens_in_batch=max_tokens_in_batch,
        ),
    )
    request_gen = SyntheticRequestGeneratorConfig(
        seed=args.seed,
        num_requests=args.requests,
        length_generator_config=FixedRequestLengthGeneratorConfig(
            seed=args.seed,
            prefill_tokens=p,
            decode_tokens=d,
            max_tokens=request_max_tokens,
        ),
        interval_generator_config=PoissonRequestIntervalGeneratorConfig(
            seed=args.seed,
            qps=args.qps,
        ),
    )
    predictor = RandomForrestExecutionTimePredictorConfig(
        model_profiling_dataset=f"local/{PROFILE_NAME}",
        network_profiling_dataset=f"local/{NETWORK_PROFILE_NAME}",
        cache_dir=args.cache_dir,
        prediction_max_tokens_per_request=pred_max_tokens,
        prediction_max_prefill_chunk_size=max(4096, math.ceil(p / 32) * 32),
        prediction_max_batch_size=max(128, args.batch_size_cap),
        num_training_job_threads=1,
        k_fold_cv_splits=2,
        num_estimators=[args.rf_estimators],
        max_depth=[args.rf_max_depth],
        min_samples_split=[2],
        use_native_execution_time_predictor=args.native_predictor,
        upload_predictions=False,
    )
    metrics = MetricsConfig(
        write_metrics=True,  # vidur default: collect metrics in memory
        write_json_trace=False,
        enable_chrome_trace=False,
        store_plots=False,
        save_table_to_wandb=False,
        wandb_project=None,
        wandb_group=None,
        output_dir=output_dir,
    )
    return SimulationConfig(
        seed=args.seed,
        log_level="warning",
        cluster_config=cluster,
        request_generator_config=request_gen,
        execution_time_predictor_config=predictor,
        metrics_config=metrics,
    )


def _median(values):
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

    import vidur.logger  # noqa: F401  (installs vidur's stdout handler; replaced below)

    _quiet_vidur_logging(args.verbose)

    from vidur.execution_time_predictor import ExecutionTimePredictorRegistry
    from vidur.execution_time_predictor import sklearn_execution_time_predictor as skp
    from vidur.metrics.constants import (
        BatchMetricsCountDistribution,
        RequestMetricsTimeDistributions,
    )
    from vidur.simulator import Simulator
    from vidur.utils.random import set_seeds

    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vidur_run_") as out_dir:
        config = build_config(args, out_dir)
        cluster = config.cluster_config

        # ---- setup: profile files, RF training, prediction tables (cached) ----
        t0 = time.perf_counter()
        profile_paths = write_synthetic_profile(
            Path(args.cache_dir), cluster.cache_config.block_size
        )

        def _no_hf(self):
            raise RuntimeError("HuggingFace is not reachable; using local profile")

        skp.SklearnExecutionTimePredictor._load_predictions_from_hf = _no_hf
        skp.SklearnExecutionTimePredictor._get_input_files = lambda self: profile_paths

        pred_dir = Path(args.cache_dir) / "predictions"
        before = set(pred_dir.rglob("*.csv.xz")) if pred_dir.exists() else set()
        predictor = ExecutionTimePredictorRegistry.get(
            config.execution_time_predictor_config.get_type(),
            predictor_config=config.execution_time_predictor_config,
            replica_config=cluster.replica_config,
            cache_config=cluster.cache_config,
        )
        after = set(pred_dir.rglob("*.csv.xz")) if pred_dir.exists() else set()
        setup_s = time.perf_counter() - t0
        setup_cache = "cold" if after - before else "warm"
        if args.setup_only:
            print(
                json.dumps(
                    {
                        "simulator": "vidur 0.0.26",
                        "setup_s": round(setup_s, 3),
                        "setup_cache": setup_cache,
                        "cache_dir": args.cache_dir,
                    }
                )
            )
            return 0

        # Reuse the predictor built above instead of rebuilding it in Simulator().
        ExecutionTimePredictorRegistry.get = classmethod(lambda cls, *a, **k: predictor)

        # ---- simulation ----
        set_seeds(args.seed)
        t1 = time.perf_counter()
        sim = Simulator(config)
        init_s = time.perf_counter() - t1
        sim._write_output = lambda: None  # no CSV/plot/trace writing
        t2 = time.perf_counter()
        sim.run()
        wall_s = time.perf_counter() - t2

        ms = sim.metric_store
        rm = ms._request_metrics_time_distributions

        def series(metric):
            return [y for _, y in rm[metric]._data_series]

        e2e = series(RequestMetricsTimeDistributions.REQUEST_E2E_TIME)
        ttft = series(RequestMetricsTimeDistributions.PREFILL_TIME_E2E)
        tpot = series(
            RequestMetricsTimeDistributions.DECODE_TIME_EXECUTION_PLUS_PREEMPTION_NORMALIZED
        )
        num_batches = len(
            ms._batch_metrics_count_distribution[BatchMetricsCountDistribution.BATCH_SIZE]
        )

        result = {
            "simulator": "vidur 0.0.26",
            "model": MODEL_NAME,
            "device": f"{DEVICE} ({NETWORK_DEVICE} node, TP1/PP1)",
            "profile": f"synthetic roofline ({PROFILE_NAME})",
            "scheduler": f"vllm (batch_size_cap={args.batch_size_cap}, "
            f"max_tokens_in_batch={cluster.replica_scheduler_config.max_tokens_in_batch})",
            "global_scheduler": args.global_scheduler,
            "predictor": "random_forest" + (" + native lookup" if args.native_predictor else ""),
            "replicas": args.replicas,
            "qps": args.qps,
            "prefill_tokens": args.prefill_tokens,
            "decode_tokens": args.decode_tokens,
            "seed": args.seed,
            "requests": args.requests,
            "completed": len(e2e),
            "num_batches": num_batches,
            "wall_s": round(wall_s, 4),
            "requests_per_s": round(args.requests / wall_s, 1),
            "init_s": round(init_s, 4),
            "setup_s": round(setup_s, 3),
            "setup_cache": setup_cache,
            "sim_time_s": round(sim._time, 4),
            "ttft_median_s": _median(ttft),
            "tpot_median_s": _median(tpot),
            "e2e_median_s": _median(e2e),
        }
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
