"""gearshift.agents.metrics: engine metric parsers, rate calculation and scrapers.

Parsers read the engines' real formats (Prometheus text of every engine of the catalog,
trtllm-serve JSON iteration stats) into `EngineSnapshot`s;
`RateCalculator` turns successive snapshots into `EngineSample`s; `EngineScraper`
fetches over HTTP and never raises; `to_proto` fills a `DeploymentReport`.
"""

from gearshift.agents.metrics.model import (
    ABSENT,
    EngineSample,
    EngineSnapshot,
    Histogram,
    MetricsParseError,
    Quantiles,
    Skip,
    SkipReason,
)
from gearshift.agents.metrics.prometheus_text import parse_prometheus_text
from gearshift.agents.metrics.rates import (
    RateCalculator,
    bucket_quantile,
    histogram_delta,
    quantiles_of,
    to_proto,
)
from gearshift.agents.metrics.scraper import (
    EngineScraper,
    MetricSource,
    ScraperMetrics,
    read_engine_metrics,
)
from gearshift.agents.metrics.trtllm_json import parse_trtllm_json

__all__ = [
    "ABSENT",
    "EngineSample",
    "EngineScraper",
    "EngineSnapshot",
    "Histogram",
    "MetricSource",
    "MetricsParseError",
    "Quantiles",
    "RateCalculator",
    "ScraperMetrics",
    "Skip",
    "SkipReason",
    "bucket_quantile",
    "histogram_delta",
    "parse_prometheus_text",
    "parse_trtllm_json",
    "quantiles_of",
    "read_engine_metrics",
    "to_proto",
]
