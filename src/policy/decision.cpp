#include "policy/decision.h"

#include <algorithm>
#include <stdexcept>

namespace hybrimoe {

LayerDecider::LayerDecider(std::shared_ptr<ExpertCache> cache, std::shared_ptr<SchedulePolicy> scheduler,
                           std::shared_ptr<PrefetchPolicy> prefetcher, CostModel cost, DeciderConfig cfg)
    : cache_(std::move(cache)), scheduler_(std::move(scheduler)), prefetcher_(std::move(prefetcher)),
      cost_(std::move(cost)), cfg_(cfg) {
    if (!cache_ || !scheduler_ || !prefetcher_) {
        throw std::invalid_argument("decision rules: the cache, scheduler and prefetcher are required");
    }
    if (cfg_.prefetch_layers < 0) throw std::invalid_argument("decision rules: prefetch_layers must be >= 0");
    cost_.validate();
    no_prefetcher_ = prefetcher_->name() == "none";
    used_.resize((size_t) cache_->n_layers());
    pending_unpin_.resize((size_t) cache_->n_layers());
}

void LayerDecider::take_evictions(ExpertPlacement & place, DecisionRecord * rec) {
    std::vector<int64_t> keys = cache_->take_evicted();
    if (keys.empty()) return;
    if (rec) rec->evicted.insert(rec->evicted.end(), keys.begin(), keys.end());
    place.evicted(keys);
}

bool LayerDecider::load(int layer, int expert, ExpertPlacement::Kind kind, ExpertPlacement & place) {
    const double bytes = place.load(layer, expert, kind);
    if (bytes <= 0.0) return false;
    pcie_free_s_ += cost_.h2d(bytes);
    if (kind != ExpertPlacement::kDemand) {  // demand loads are in the plan
        extra_copy_s_ += cost_.h2d(bytes);
        extra_copy_bytes_ += bytes;
        ++extra_copies_;
    }
    if (kind == ExpertPlacement::kPrefetch || kind == ExpertPlacement::kFill) {  // queued after the GPU launch
        post_launch_copy_s_ += cost_.h2d(bytes);
        post_launch_copy_bytes_ += bytes;
        ++post_launch_copies_;
    }
    // admitted already (ready when admitted: unknown then); the copy's estimated end is its ready time
    if (kind != ExpertPlacement::kFirstUse) cache_->set_ready(layer, expert, now_s_ + pcie_free_s_);
    return true;
}

const std::vector<uint8_t> & LayerDecider::split(int64_t ubatch, int layer, const int32_t * ids, int n_tokens,
                                                 int top_k, std::vector<float> & scores, double expert_bytes,
                                                 double now_s, double pcie_free_s, ExpertPlacement & place,
                                                 DecisionRecord * rec) {
    if (layer < 0 || layer >= cache_->n_layers()) {
        throw std::invalid_argument("decision rules: MoE layer " + std::to_string(layer) + " out of range");
    }
    const int E = cache_->n_experts();
    in_.set_routing(ids, n_tokens, top_k, E);
    in_.layer = layer;
    in_.expert_bytes = expert_bytes;
    obs_.step = ubatch;
    obs_.set_routed(layer, n_tokens, top_k, E, in_.experts, in_.loads);
    if (!scores.empty() && scores.size() != (size_t) n_tokens * E) {
        throw std::invalid_argument("decision rules: scores must be [n_tokens, " + std::to_string(E) + "] or empty");
    }
    obs_.scores.swap(scores);
    cache_->observe(obs_);
    now_s_ = now_s;
    std::vector<int32_t> & used = used_[(size_t) layer];
    for (size_t i = 0; i < in_.size(); ++i) {
        const int32_t e = in_.experts[i];
        cache_->access(layer, e, now_s);
        cache_->pin(layer, e);
        used.push_back(e);
        if (cfg_.has_slots && cache_->resident(layer, e)) {
            in_.cached[i] = 1;
            in_.ready_s[i] = std::max(0.0, cache_->ready_s(layer, e) - now_s);
        }
    }
    // the RAM tier's reads, where there is one (the split sees which experts are not in RAM yet)
    int slots = 1;
    const double rs = place.read_s(layer, slots);
    if (rs > 0.0) {
        in_.on_disk.assign(in_.size(), 0);
        for (size_t i = 0; i < in_.size(); ++i) in_.on_disk[i] = place.on_disk(layer, in_.experts[i]) ? 1 : 0;
        in_.read_s = rs;
        in_.read_slots = std::max(1, slots);
    } else {
        in_.read_s = 0.0;
        in_.read_slots = 1;
    }
    pcie_free_s_ = std::max(0.0, pcie_free_s);
    in_.pcie_free_s = pcie_free_s_;
    extra_copy_s_ = 0.0;
    extra_copy_bytes_ = 0.0;
    extra_copies_ = 0;
    post_launch_copy_s_ = 0.0;
    post_launch_copy_bytes_ = 0.0;
    post_launch_copies_ = 0;
    scheduler_->plan(in_, cost_, plan_);
    if (plan_.on_gpu.size() != in_.size() ||
        plan_.gpu_experts.size() + plan_.cpu_experts.size() != in_.size()) {
        throw std::runtime_error("schedule policy '" + scheduler_->name() + "' returned a plan of the wrong size");
    }
    pos_.assign((size_t) E, -1);
    for (size_t i = 0; i < in_.size(); ++i) pos_[(size_t) in_.experts[i]] = (int32_t) i;
    for (int side = 0; side < 2; ++side) {
        for (int32_t e : side ? plan_.gpu_experts : plan_.cpu_experts) {
            const int32_t i = e >= 0 && e < E ? pos_[(size_t) e] : -1;
            if (i < 0 || plan_.on_gpu[(size_t) i] != side) {
                throw std::runtime_error("schedule policy '" + scheduler_->name() + "' returned a plan whose " +
                                         (side ? "GPU" : "CPU") + " list disagrees with its split (expert " +
                                         std::to_string(e) + ")");
            }
        }
    }
    if (rec) {
        rec->ubatch = ubatch;
        rec->layer = layer;
        rec->n_tokens = n_tokens;
        rec->top_k = top_k;
        rec->ids.assign(ids, ids + (size_t) n_tokens * top_k);
        rec->scores = obs_.scores;
        rec->expert_bytes = expert_bytes;
        rec->now_s = now_s;
        rec->pcie_free_s = pcie_free_s_;
        rec->experts = in_.experts;
        rec->loads = in_.loads;
        rec->cached = in_.cached;
        rec->ready_s = in_.ready_s;
        rec->on_disk = in_.on_disk;
        rec->read_s = in_.read_s;
        rec->read_slots = in_.read_slots;
        rec->planned_gpu = plan_.on_gpu;
    }
    on_gpu_ = plan_.on_gpu;
    if (!cfg_.has_slots) std::fill(on_gpu_.begin(), on_gpu_.end(), 0);

    // demand loads, in the plan's copy order: admit; a load the cache refuses runs on the CPU
    auto demand = [&](size_t i) {
        const int32_t e = in_.experts[i];
        if (cache_->admit(layer, e, 0.0, false, /*demand=*/true)) {
            take_evictions(place, rec);
            load(layer, e, ExpertPlacement::kDemand, place);
            if (rec) rec->loaded.push_back(e);
        } else {
            on_gpu_[i] = 0;
            if (rec) rec->declined.push_back(e);
        }
    };
    for (int32_t e : plan_.load_experts) {
        const int32_t i = e >= 0 && e < E ? pos_[(size_t) e] : -1;
        if (i >= 0 && on_gpu_[(size_t) i] && !in_.cached[(size_t) i] && !cache_->resident(layer, e)) demand((size_t) i);
    }
    // a policy's plan lists every uncached GPU expert among its loads; one it left out is loaded last
    for (size_t i = 0; i < in_.size(); ++i) {
        if (on_gpu_[i] && !in_.cached[i] && !cache_->resident(layer, in_.experts[i])) demand(i);
    }
    take_evictions(place, rec);
    // resident experts whose weights were never copied (initial fill) are copied at their first use
    for (size_t i = 0; i < in_.size(); ++i) {
        if (!on_gpu_[i] || !in_.cached[i]) continue;
        if (load(layer, in_.experts[i], ExpertPlacement::kFirstUse, place) && rec) {
            rec->first_use.push_back(in_.experts[i]);
        }
    }
    // the prediction of the split that runs: the scheduler's, or its re-evaluation when the cache refused loads or
    // there are no slots (those experts run on the CPU)
    if (on_gpu_ == plan_.on_gpu) {
        run_plan_ = plan_;
    } else {
        evaluate_plan(in_, cost_, on_gpu_, run_plan_);
        run_plan_.method = plan_.method + "+cpu-fallback";
    }
    plan_cpu_end_s_ = run_plan_.cpu_end_s;
    plan_gpu_end_s_ = run_plan_.gpu_end_s;
    if (rec) rec->on_gpu = on_gpu_;
    charge_extra_copies(rec);
    return on_gpu_;
}

namespace {

// The copies queued after a plan (extra_s: first use, prefetch, fill) delay its CPU share on a host that pays for
// copies; those queued after its GPU launch (post_s) delay the launch's outputs on a device that cannot compute
// while it copies. cpu_end_s / gpu_end_s: the plan's ends before them. Sets plan's ends and makespan.
void charge_late_copies(SchedulePlan & plan, const CostModel & cost, double cpu_end_s, double gpu_end_s,
                        double extra_s, double post_s) {
    if (!plan.cpu_experts.empty()) plan.cpu_end_s = cpu_end_s + cost.cpu_copy_blocking(extra_s);
    if (!plan.gpu_experts.empty()) plan.gpu_end_s = gpu_end_s + cost.copy_blocking(post_s);
    plan.makespan_s = std::max(plan.cpu_end_s, plan.gpu_end_s);
}

// Seconds of n copies of `bytes` bytes in all.
double copies_s(const CostModel & cost, double bytes, int n) {
    return n > 0 ? bytes / cost.h2d_bandwidth_Bps + n * cost.h2d_latency_s : 0.0;
}

}  // namespace

void LayerDecider::charge_extra_copies(DecisionRecord * rec) {
    charge_late_copies(run_plan_, cost_, plan_cpu_end_s_, plan_gpu_end_s_, extra_copy_s_, post_launch_copy_s_);
    if (rec) {
        rec->makespan_s = run_plan_.makespan_s;
        rec->extra_copy_bytes = extra_copy_bytes_;
        rec->extra_copies = extra_copies_;
        rec->post_launch_copy_bytes = post_launch_copy_bytes_;
        rec->post_launch_copies = post_launch_copies_;
    }
}

double record_makespan(const DecisionRecord & rec, const CostModel & cost) {
    const size_t k = rec.experts.size();
    if (rec.loads.size() != k || rec.cached.size() != k || rec.ready_s.size() != k || rec.on_gpu.size() != k) {
        throw std::invalid_argument("record_makespan: record (ubatch " + std::to_string(rec.ubatch) + ", MoE layer " +
                                    std::to_string(rec.layer) + ") has experts, loads, cached, ready_s and on_gpu "
                                    "of different lengths");
    }
    LayerInput in;
    in.layer = rec.layer;
    in.n_tokens = rec.n_tokens;
    in.expert_bytes = rec.expert_bytes;
    in.pcie_free_s = rec.pcie_free_s;
    in.experts = rec.experts;
    in.loads = rec.loads;
    in.cached = rec.cached;
    in.ready_s = rec.ready_s;
    if (rec.on_disk.size() == k) in.on_disk = rec.on_disk;
    in.read_s = rec.read_s;
    in.read_slots = std::max(1, rec.read_slots);
    SchedulePlan plan;
    evaluate_plan(in, cost, rec.on_gpu, plan);
    charge_late_copies(plan, cost, plan.cpu_end_s, plan.gpu_end_s,
                       copies_s(cost, rec.extra_copy_bytes, rec.extra_copies),
                       copies_s(cost, rec.post_launch_copy_bytes, rec.post_launch_copies));
    return plan.makespan_s;
}

bool LayerDecider::wants_prefetch(int n_moe_layers) const {
    return cfg_.has_slots && cfg_.prefetch_layers > 0 && !no_prefetcher_ && in_.layer + 1 < n_moe_layers;
}

void LayerDecider::prefetch(const std::vector<Prediction> & predictions, int n_moe_layers, ExpertPlacement & place,
                            DecisionRecord * rec) {
    if (!wants_prefetch(n_moe_layers)) return;
    plan_prefetches(in_.layer, in_.n_tokens, obs_.top_k, predictions, n_moe_layers, place, rec);
    charge_extra_copies(rec);
}

void LayerDecider::prefetch_ahead(int64_t ubatch, int from_layer, int n_tokens, int top_k, double now_s,
                                  double pcie_free_s, const std::vector<Prediction> & predictions, int n_moe_layers,
                                  ExpertPlacement & place, DecisionRecord * rec) {
    if (!cfg_.has_slots || cfg_.prefetch_layers <= 0 || no_prefetcher_ || from_layer + 1 >= n_moe_layers) return;
    if (rec) {
        rec->prefetch_only = true;
        rec->ubatch = ubatch;
        rec->layer = from_layer;
        rec->n_tokens = n_tokens;
        rec->top_k = top_k;
        rec->now_s = now_s;
        rec->pcie_free_s = pcie_free_s;
    }
    // this device's last plan has run: its copies are charged to none (the next split sees them in the queue)
    now_s_ = now_s;
    pcie_free_s_ = pcie_free_s;
    plan_prefetches(from_layer, n_tokens, top_k, predictions, n_moe_layers, place, rec);
}

void LayerDecider::plan_prefetches(int ml, int n_tokens, int top_k, const std::vector<Prediction> & predictions,
                                   int n_moe_layers, ExpertPlacement & place, DecisionRecord * rec) {
    const int E = cache_->n_experts();
    pctx_.layer = ml;
    pctx_.n_tokens = n_tokens;
    pctx_.top_k = top_k;
    // the prefetcher works on the caller's clock, as the cache's ready times do (start_s comes relative)
    if (rec) rec->predictions = predictions;
    pctx_.now_s = now_s_;
    pctx_.pcie_free_at_s = now_s_ + pcie_free_s_;
    pctx_.predictions = predictions;  // copy-assigned: the buffers of the last call are reused
    for (Prediction & p : pctx_.predictions) p.start_s += now_s_;
    prefetch_declined_ = 0;
    const auto reqs = prefetcher_->plan(pctx_, *cache_, cost_);
    for (const auto & r : reqs) {
        const int j = r.first, e = r.second;
        if (j <= ml || j >= n_moe_layers || j > ml + cfg_.prefetch_layers || e < 0 || e >= E) {
            throw std::invalid_argument("prefetch policy '" + prefetcher_->name() + "' asked for (layer " +
                                        std::to_string(j) + ", expert " + std::to_string(e) +
                                        "), outside the next " + std::to_string(cfg_.prefetch_layers) +
                                        " layers or the expert range");
        }
        if (cache_->resident(j, e) || !place.holds(j)) continue;
        if (!cache_->admit(j, e, 0.0, true)) {
            ++prefetch_declined_;
            continue;
        }
        take_evictions(place, rec);
        cache_->pin(j, e);
        pending_unpin_[(size_t) j].push_back(e);
        load(j, e, ExpertPlacement::kPrefetch, place);
        if (rec) rec->prefetched.emplace_back(j, e);
    }
    take_evictions(place, rec);
}

void LayerDecider::fills(ExpertPlacement & place, DecisionRecord * rec) {
    if (!cfg_.has_slots || !cfg_.fill_on_miss) return;
    const int ml = in_.layer;
    // what one fill costs the CPU share on a host that pays for copies (0 when copies cost it nothing)
    const double fill_block =
        run_plan_.cpu_experts.empty() ? 0.0 : cost_.cpu_copy_blocking(cost_.h2d(in_.expert_bytes));
    // and the GPU share's (its outputs are read after the fill on a device that cannot compute while it copies)
    const double fill_gpu_block =
        run_plan_.gpu_experts.empty() ? 0.0 : cost_.copy_blocking(cost_.h2d(in_.expert_bytes));
    for (size_t i = 0; i < in_.size(); ++i) {
        const int32_t e = in_.experts[i];
        if (on_gpu_[i] || cache_->resident(ml, e)) continue;
        if (pcie_free_s_ >= run_plan_.makespan_s) break;
        if (fill_block > 0.0 && run_plan_.cpu_end_s + fill_block > run_plan_.makespan_s) break;
        if (fill_gpu_block > 0.0 && run_plan_.gpu_end_s + fill_gpu_block > run_plan_.makespan_s) break;
        if (!cache_->admit(ml, e, 0.0, false)) continue;
        take_evictions(place, rec);
        load(ml, e, ExpertPlacement::kFill, place);
        if (rec) rec->filled.push_back(e);
        charge_extra_copies(rec);
    }
    take_evictions(place, rec);
}

void LayerDecider::release(int layer) {
    if (layer < 0 || layer >= (int) used_.size()) return;
    for (int32_t e : used_[(size_t) layer]) cache_->unpin(layer, e);
    for (int32_t e : pending_unpin_[(size_t) layer]) cache_->unpin(layer, e);
    used_[(size_t) layer].clear();
    pending_unpin_[(size_t) layer].clear();
}

}  // namespace hybrimoe
