"""Type stubs of hybrimoe._core: the HybriMoE policy core and trace simulator (bindings/core, src/policy)."""
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import numpy.typing as npt

class CostModel:
    cpu_a_s: float
    cpu_b_s: float
    cpu_c_s: float
    cpu_startup_s: float
    gpu_a_s: float
    gpu_b_s: float
    h2d_bandwidth_Bps: float
    h2d_latency_s: float
    act_a_s: float
    act_b_s: float
    layer_a_s: float
    layer_b_s: float
    dense_a_s: float
    dense_b_s: float
    copy_overlap: float
    cpu_copy_overlap: float
    disk_bandwidth_Bps: float
    disk_latency_s: float
    disk_queue_depth: float
    def __init__(self) -> None: ...
    @property
    def has_disk(self) -> bool: ...
    def disk_read(self, bytes: float) -> float: ...
    def cpu(self, n_tokens: int) -> float: ...
    def gpu(self, n_tokens: int) -> float: ...
    def h2d(self, bytes: float) -> float: ...
    def act(self, n_tokens: int) -> float: ...
    def layer(self, n_tokens: int) -> float: ...
    def dense(self, n_tokens: int) -> float: ...
    def validate(self) -> None: ...

class LayerInput:
    layer: int
    n_tokens: int
    expert_bytes: float
    pcie_free_s: float
    experts: list[int]
    loads: list[int]
    cached: list[int]
    ready_s: list[float]
    def __init__(self, experts: Sequence[int] = ..., loads: Sequence[int] = ..., cached: Sequence[int] = ...,
                 ready_s: Sequence[float] = ..., expert_bytes: float = 0.0, n_tokens: int = 1, layer: int = 0,
                 pcie_free_s: float = 0.0) -> None: ...
    def __len__(self) -> int: ...
    def validate(self) -> None: ...
    def set_routing(self, ids: npt.ArrayLike, n_experts: int) -> None: ...

class SchedulePlan:
    on_gpu: list[int]
    cpu_experts: list[int]
    gpu_experts: list[int]
    load_experts: list[int]
    makespan_s: float
    cpu_end_s: float
    gpu_end_s: float
    pcie_end_s: float
    method: str

def evaluate_plan(layer_input: LayerInput, cost: CostModel, on_gpu: Sequence[int]) -> SchedulePlan: ...
def assign_pairs(layer_input: LayerInput, plan: SchedulePlan, ids: npt.ArrayLike) -> npt.NDArray[np.uint8]: ...

class SchedulePolicy:
    def __init__(self) -> None: ...
    def name(self) -> str: ...
    def split(self, layer_input: LayerInput, cost: CostModel) -> Sequence[int]: ...
    def plan(self, layer_input: LayerInput, cost: CostModel) -> SchedulePlan: ...

class HybriMoEScheduler(SchedulePolicy):
    def greedy_split(self, layer_input: LayerInput, cost: CostModel) -> list[int]: ...

class CpuUncachedScheduler(SchedulePolicy): ...
class GpuOnDemandScheduler(SchedulePolicy): ...

class StaticLayerScheduler(SchedulePolicy):
    def __init__(self, n_cpu_layers: int) -> None: ...
    @property
    def n_cpu_layers(self) -> int: ...

class ExhaustiveScheduler(SchedulePolicy):
    def __init__(self, max_exhaustive: int = 10) -> None: ...

def make_scheduler(name: str, n_cpu_layers: int = 0) -> SchedulePolicy: ...

class LayerObservation:
    step: int
    layer: int
    n_tokens: int
    top_k: int
    n_experts: int
    experts: list[int]
    loads: list[int]
    scores: list[float]
    def __init__(self) -> None: ...

class FutureAccesses:
    n_layers: int
    n_experts: int
    uses: list[list[int]]
    def __init__(self) -> None: ...

class CacheStats:
    accesses: int
    demand_hits: int
    prefetch_hits: int
    misses: int
    late: int
    admissions: int
    evictions: int
    declined: int
    @property
    def hit_rate(self) -> float: ...
    @property
    def demand_hit_rate(self) -> float: ...

class CachePolicy:
    def __init__(self) -> None: ...
    def name(self) -> str: ...
    def reset(self, n_layers: int, n_experts: int) -> None: ...
    def observe(self, obs: LayerObservation) -> None: ...
    def priority(self, layer: int, expert: int) -> float: ...
    def admit(self, layer: int, expert: int) -> bool: ...
    def bypass(self) -> bool: ...
    def prepare(self, future: FutureAccesses) -> None: ...
    def clairvoyant(self) -> bool: ...

class MRSPolicy(CachePolicy):
    def __init__(self, alpha: float = 0.5, p: int = 0, use_max: bool = False) -> None: ...
    def score(self, layer: int, expert: int) -> float: ...
    def set_score(self, layer: int, expert: int, score: float) -> None: ...

class LRUPolicy(CachePolicy): ...
class LFUPolicy(CachePolicy): ...

class StaticPolicy(CachePolicy):
    def __init__(self, keys: Sequence[int], weights: Sequence[float] = ...) -> None: ...

class BeladyPolicy(CachePolicy): ...

def make_cache_policy(name: str) -> CachePolicy: ...

class ExpertCache:
    def __init__(self, expert_bytes_per_layer: Sequence[float], n_experts: int, budget_bytes: float,
                 policy: CachePolicy) -> None: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def budget_bytes(self) -> float: ...
    @property
    def used_bytes(self) -> float: ...
    @property
    def total_expert_bytes(self) -> float: ...
    @property
    def n_resident(self) -> int: ...
    @property
    def policy(self) -> CachePolicy: ...
    @property
    def stats(self) -> CacheStats: ...
    def resident(self, layer: int, expert: int) -> bool: ...
    def ready_s(self, layer: int, expert: int) -> float: ...
    def pinned(self, layer: int, expert: int) -> bool: ...
    def resident_keys(self) -> list[int]: ...
    def observe(self, obs: LayerObservation) -> None: ...
    def access(self, layer: int, expert: int, now_s: float = ...) -> int: ...
    def admit(self, layer: int, expert: int, ready_s: float = 0.0, by_prefetch: bool = False,
              demand: bool = False) -> bool: ...
    def admit_read_ahead(self, layer: int, expert: int, ready_s: float = 0.0) -> bool: ...
    def found_read_ahead(self, layer: int, expert: int) -> None: ...
    def admit_batch(self, layer: int, experts: Sequence[int], ready_s: Sequence[float] = ...,
                    by_prefetch: bool = ...) -> int: ...
    def pin(self, layer: int, expert: int) -> None: ...
    def unpin(self, layer: int, expert: int) -> None: ...
    def evict(self, layer: int, expert: int) -> None: ...
    def fill(self, keys: Sequence[int]) -> int: ...
    def reset_stats(self) -> None: ...
    def set_frequency_admission(self, on: bool, window: int = 0) -> None: ...
    @property
    def frequency_admission(self) -> bool: ...
    def frequency(self, layer: int, expert: int) -> float: ...
    def set_record_evicted(self, on: bool) -> None: ...
    def take_evicted(self) -> list[int]: ...
    def set_streaming_demand(self, min_active_fraction: float) -> None: ...
    @property
    def streaming_demand(self) -> float: ...
    def on_probation(self, layer: int, expert: int) -> bool: ...

class Prediction:
    layer: int
    distance: int
    confidence: float
    start_s: float
    expert_bytes: float
    experts: list[int]
    loads: list[int]
    def __init__(self) -> None: ...

class PrefetchContext:
    layer: int
    n_tokens: int
    top_k: int
    now_s: float
    pcie_free_at_s: float
    predictions: list[Prediction]
    def __init__(self) -> None: ...

class PrefetchPolicy:
    def __init__(self) -> None: ...
    def name(self) -> str: ...
    def plan(self, ctx: PrefetchContext, cache: ExpertCache, cost: CostModel) -> Iterable[tuple[int, int]]: ...

class NoPrefetcher(PrefetchPolicy): ...

class TopKPrefetcher(PrefetchPolicy):
    def __init__(self, count: int = 0) -> None: ...

class ImpactPrefetcher(PrefetchPolicy):
    def __init__(self, max_copies: int = 0, max_candidates: int = 12, use_confidence: bool = True,
                 waste_weight: float = ..., share_equal_evaluations: bool = True) -> None: ...
    @property
    def evaluations(self) -> int: ...

def make_prefetcher(name: str) -> PrefetchPolicy: ...

DEFAULT_PREDICTION_CONFIDENCE: tuple[float, ...]  # engine: assumed confidence per look-ahead distance
DEFAULT_PREFETCH_WASTE_WEIGHT: float  # ImpactPrefetcher: weight of a wrong prediction's copy time

class Trace:
    def __init__(self, expert_ids: npt.ArrayLike, prompt_offsets: npt.ArrayLike, expert_bytes: Sequence[float],
                 n_experts: int, n_dense_layers: int = 0, scores: Optional[npt.ArrayLike] = None) -> None: ...
    n_tokens: int
    n_layers: int
    top_k: int
    n_experts: int
    n_dense_layers: int
    expert_bytes: list[float]
    @property
    def n_prompts(self) -> int: ...
    @property
    def has_scores(self) -> bool: ...

class TruthModel:
    seed: int
    cpu_noise: float
    gpu_noise: float
    h2d_noise: float
    act_noise: float
    layer_noise: float
    cpu_startup_extra_s: float
    contention: float
    cpu_scale: float
    gpu_scale: float
    h2d_scale: float
    def __init__(self) -> None: ...
    def validate(self) -> None: ...

DEFAULT_PREDICTOR_RECALL: tuple[float, ...]  # simulator: assumed predictor recall per distance

class RamTierConfig:
    reads: str
    keep: bool
    lookahead: int
    ready_first: bool
    fault_bytes: float
    read_around: float
    other_bytes: float
    fault_bandwidth_Bps: float
    read_bandwidth_Bps: float
    read_cpu_s_per_byte: float
    recall: list[float]
    def __init__(self) -> None: ...
    def validate(self) -> None: ...

class SimConfig:
    stage: str
    ubatch: int
    prompt_tokens: int
    prefetch_depth: int
    recall: list[float]
    predictor_seed: int
    fill_on_miss: bool
    max_tokens: int
    timeline_step: int
    timeline_layers: int
    ram: RamTierConfig
    def __init__(self) -> None: ...
    def validate(self) -> None: ...

class TimelineEvent:
    step: int
    layer: int
    resource: int
    expert: int
    kind: int
    start_s: float
    end_s: float

class SimResult:
    stage: str
    tokens: int
    steps: int
    prompts: int
    total_s: float
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    cache: CacheStats
    bytes_h2d: float
    bytes_demand: float
    bytes_prefetch: float
    bytes_fill: float
    prefetch_issued: int
    prefetch_declined: int
    prefetch_used: int
    cpu_busy_s: float
    gpu_busy_s: float
    link_busy_s: float
    predicted_moe_s: float
    charged_moe_s: float
    ram_cache: CacheStats
    bytes_disk: float
    bytes_disk_prefetch: float
    disk_reads: int
    page_faults: int
    ram_prefetch_issued: int
    disk_busy_s: float
    decision_us_mean: float
    prefetch_us_mean: float
    layer_moe_s: list[float]
    device_cache: list[CacheStats]
    device_bytes_h2d: list[float]
    device_link_busy_s: list[float]
    timeline: list[TimelineEvent]

def make_steps(trace: Trace, first_prompt: int, end_prompt: int, config: SimConfig) -> list[tuple[int, int, int]]: ...
def replay_cache(trace: Trace, cache: ExpertCache, first_prompt: int, end_prompt: int,
                 config: SimConfig) -> CacheStats: ...
def simulate(trace: Trace, cache: ExpertCache, scheduler: SchedulePolicy, prefetcher: PrefetchPolicy,
             planner: CostModel, truth_cost: CostModel, truth: TruthModel, config: SimConfig, first_prompt: int,
             end_prompt: int, ram_cache: ExpertCache | None = None) -> SimResult: ...
def simulate_devices(trace: Trace,
                     devices: list[tuple[ExpertCache, SchedulePolicy, PrefetchPolicy, CostModel, CostModel]],
                     layer_device: list[int], shared_link: bool, truth: TruthModel, config: SimConfig,
                     first_prompt: int, end_prompt: int, ram_cache: ExpertCache | None = None) -> SimResult: ...
def replay_decisions(log: Iterable[dict[str, Any]], cache: ExpertCache, scheduler: SchedulePolicy,
                     prefetcher: PrefetchPolicy, cost_model: CostModel, has_slots: bool, prefetch_layers: int,
                     fill_on_miss: bool) -> list[dict[str, Any]]: ...
def first_difference(a: Iterable[dict[str, Any]], b: Iterable[dict[str, Any]]) -> str: ...
def record_makespans(log: Iterable[dict[str, Any]], cost_model: CostModel) -> list[float]: ...
