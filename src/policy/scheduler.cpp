#include "policy/scheduler.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace hybrimoe {

void LayerInput::validate() const {
    const size_t k = experts.size();
    if (loads.size() != k || cached.size() != k || ready_s.size() != k) {
        throw std::invalid_argument("LayerInput: experts, loads, cached and ready_s must have the same length (got " +
                                    std::to_string(k) + ", " + std::to_string(loads.size()) + ", " +
                                    std::to_string(cached.size()) + ", " + std::to_string(ready_s.size()) + ")");
    }
    if (n_tokens < 1) {
        throw std::invalid_argument("LayerInput.n_tokens must be >= 1, got " + std::to_string(n_tokens));
    }
    if (!(expert_bytes >= 0.0) || !(pcie_free_s >= 0.0)) {
        throw std::invalid_argument("LayerInput.expert_bytes and pcie_free_s must be >= 0");
    }
    for (size_t i = 0; i < k; ++i) {
        if (loads[i] < 1) {
            throw std::invalid_argument("LayerInput: load of expert " + std::to_string(experts[i]) +
                                        " must be >= 1, got " + std::to_string(loads[i]));
        }
        if (!(ready_s[i] >= 0.0)) {
            throw std::invalid_argument("LayerInput: ready_s of expert " + std::to_string(experts[i]) +
                                        " must be >= 0");
        }
        for (size_t j = 0; j < i; ++j) {
            if (experts[j] == experts[i]) {
                throw std::invalid_argument("LayerInput: expert " + std::to_string(experts[i]) + " appears twice");
            }
        }
    }
}

void LayerInput::set_routing(const int32_t * ids, int n_tokens_, int top_k, int n_experts) {
    if (n_tokens_ < 1 || top_k < 1 || n_experts < 1) {
        throw std::invalid_argument("set_routing: n_tokens, top_k and n_experts must be >= 1");
    }
    thread_local std::vector<int32_t> pos;
    pos.assign(static_cast<size_t>(n_experts), -1);
    experts.clear();
    loads.clear();
    experts.reserve(static_cast<size_t>(n_experts));
    loads.reserve(static_cast<size_t>(n_experts));
    for (int i = 0; i < n_tokens_ * top_k; ++i) {
        const int32_t e = ids[i];
        if (e < 0 || e >= n_experts) {
            throw std::invalid_argument("set_routing: expert id " + std::to_string(e) + " at token " +
                                        std::to_string(i / top_k) + " is outside 0.." +
                                        std::to_string(n_experts - 1));
        }
        if (pos[e] < 0) {
            pos[e] = static_cast<int32_t>(experts.size());
            experts.push_back(e);
            loads.push_back(0);
        }
        loads[pos[e]] += 1;
    }
    n_tokens = n_tokens_;
    cached.assign(experts.size(), 0);
    ready_s.assign(experts.size(), 0.0);
}

namespace {

// Indices 0..k-1 ordered by load descending, ties by expert id (deterministic).
void order_by_load_desc(const LayerInput & in, std::vector<int32_t> & idx) {
    idx.resize(in.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
        if (in.loads[a] != in.loads[b]) {
            return in.loads[a] > in.loads[b];
        }
        return in.experts[a] < in.experts[b];
    });
}

}  // namespace

double evaluate_plan(const LayerInput & in, const CostModel & cost, const std::vector<uint8_t> & on_gpu,
                     SchedulePlan & out) {
    const size_t k = in.size();
    if (on_gpu.size() != k) {
        throw std::invalid_argument("evaluate_plan: on_gpu has " + std::to_string(on_gpu.size()) +
                                    " entries for " + std::to_string(k) + " activated experts");
    }
    thread_local std::vector<int32_t> idx;
    thread_local std::vector<std::pair<double, int32_t>> gpu_tasks;
    order_by_load_desc(in, idx);
    if (&out.on_gpu != &on_gpu) {
        out.on_gpu = on_gpu;
    }
    out.cpu_experts.clear();
    out.gpu_experts.clear();
    out.load_experts.clear();
    gpu_tasks.clear();

    // CPU queue order of the paper: uncached lowest load first, then cached lowest load first.
    double t_cpu = 0.0;
    for (int pass = 0; pass < 2; ++pass) {
        for (size_t r = k; r-- > 0;) {
            const int32_t i = idx[r];
            if (!on_gpu[i] && (in.cached[i] != 0) == (pass == 1)) {
                t_cpu += cost.cpu(in.loads[i]);
                out.cpu_experts.push_back(in.experts[i]);
            }
        }
    }
    if (!out.cpu_experts.empty()) {
        t_cpu += cost.cpu_startup_s;
    }

    // Copies back to back, highest load first; GPU tasks released at their copy end.
    double t_link = in.pcie_free_s;
    const double h2d = cost.h2d(in.expert_bytes);
    for (size_t r = 0; r < k; ++r) {
        const int32_t i = idx[r];
        if (!on_gpu[i]) {
            continue;
        }
        if (in.cached[i]) {
            gpu_tasks.emplace_back(in.ready_s[i], i);
        } else {
            t_link += h2d;
            out.load_experts.push_back(in.experts[i]);
            gpu_tasks.emplace_back(t_link, i);
        }
    }
    // Earliest ready first; stable keeps highest load first among equals.
    std::stable_sort(gpu_tasks.begin(), gpu_tasks.end(),
                     [](const std::pair<double, int32_t> & a, const std::pair<double, int32_t> & b) {
                         return a.first < b.first;
                     });
    double t_gpu = 0.0;
    if (!gpu_tasks.empty()) {
        t_gpu = cost.act(in.n_tokens);
        for (const auto & task : gpu_tasks) {
            t_gpu = std::max(t_gpu, task.first) + cost.gpu(in.loads[task.second]);
            out.gpu_experts.push_back(in.experts[task.second]);
        }
    }
    out.cpu_end_s = t_cpu;
    out.gpu_end_s = t_gpu;
    out.pcie_end_s = t_link;
    out.makespan_s = std::max(t_cpu, t_gpu);
    return out.makespan_s;
}

std::vector<uint8_t> assign_slots(const LayerInput & in, const SchedulePlan & plan, const int32_t * ids,
                                  int n_tokens, int top_k) {
    if (plan.on_gpu.size() != in.size()) {
        throw std::invalid_argument("assign_slots: plan does not match the layer input");
    }
    int32_t max_id = -1;
    for (int32_t e : in.experts) {
        max_id = std::max(max_id, e);
    }
    std::vector<int32_t> pos(static_cast<size_t>(max_id + 1), -1);
    for (size_t i = 0; i < in.size(); ++i) {
        pos[in.experts[i]] = static_cast<int32_t>(i);
    }
    std::vector<uint8_t> device(static_cast<size_t>(n_tokens) * top_k);
    for (size_t s = 0; s < device.size(); ++s) {
        const int32_t e = ids[s];
        if (e < 0 || e > max_id || pos[e] < 0) {
            throw std::invalid_argument("assign_slots: expert " + std::to_string(e) + " of token " +
                                        std::to_string(s / top_k) + " is not among the layer's activated experts");
        }
        device[s] = plan.on_gpu[pos[e]];
    }
    return device;
}

void SchedulePolicy::plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out) {
    out.on_gpu.assign(in.size(), 0);
    split(in, cost, out.on_gpu);
    evaluate_plan(in, cost, out.on_gpu, out);
    out.method = name();
}

void HybriMoEScheduler::greedy_split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) {
    const int k = static_cast<int>(in.size());
    on_gpu.assign(k, 0);
    done_.assign(k, 0);
    order_by_load_desc(in, by_load_asc_);
    std::reverse(by_load_asc_.begin(), by_load_asc_.end());
    const std::vector<int32_t> & asc = by_load_asc_;

    const double inf = std::numeric_limits<double>::infinity();
    const double h2d = cost.h2d(in.expert_bytes);
    const double gpu_start = cost.act(in.n_tokens);
    int p_cpu_unc = 0, p_cpu_cached = 0;    // ascending scans
    int p_gpu = k - 1, p_pcie = k - 1;      // descending scans
    double t_cpu = 0.0, t_gpu = 0.0, t_link = in.pcie_free_s;
    bool cpu_started = false, gpu_started = false;

    for (int remaining = k; remaining > 0; --remaining) {
        while (p_cpu_unc < k && (done_[asc[p_cpu_unc]] || in.cached[asc[p_cpu_unc]])) ++p_cpu_unc;
        while (p_cpu_cached < k && (done_[asc[p_cpu_cached]] || !in.cached[asc[p_cpu_cached]])) ++p_cpu_cached;
        while (p_gpu >= 0 && (done_[asc[p_gpu]] || !in.cached[asc[p_gpu]])) --p_gpu;
        while (p_pcie >= 0 && (done_[asc[p_pcie]] || in.cached[asc[p_pcie]])) --p_pcie;

        const int c = p_cpu_unc < k ? asc[p_cpu_unc] : (p_cpu_cached < k ? asc[p_cpu_cached] : -1);
        const int g = p_gpu >= 0 ? asc[p_gpu] : -1;
        const int p = p_pcie >= 0 ? asc[p_pcie] : -1;
        const double gpu_base = gpu_started ? t_gpu : gpu_start;

        const double f_gpu = g >= 0 ? std::max(gpu_base, in.ready_s[g]) + cost.gpu(in.loads[g]) : inf;
        const double f_cpu = c >= 0 ? t_cpu + (cpu_started ? 0.0 : cost.cpu_startup_s) + cost.cpu(in.loads[c]) : inf;
        const double copy_end = t_link + h2d;
        const double f_pcie = p >= 0 ? std::max(gpu_base, copy_end) + cost.gpu(in.loads[p]) : inf;

        // Ties: a cached GPU task first (no copy), then the CPU, then a copy.
        if (f_gpu <= f_cpu && f_gpu <= f_pcie) {
            t_gpu = f_gpu;
            gpu_started = true;
            on_gpu[g] = 1;
            done_[g] = 1;
        } else if (f_cpu <= f_pcie) {
            t_cpu = f_cpu;
            cpu_started = true;
            done_[c] = 1;
        } else {
            t_link = copy_end;
            t_gpu = f_pcie;
            gpu_started = true;
            on_gpu[p] = 1;
            done_[p] = 1;
        }
    }
}

void HybriMoEScheduler::split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) {
    plan(in, cost, scratch_);
    on_gpu = scratch_.on_gpu;
}

void HybriMoEScheduler::plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out) {
    greedy_split(in, cost, trial_);
    evaluate_plan(in, cost, trial_, out);
    out.method = "greedy";
    // Documented improvement over the paper: never worse than either trivial plan.
    for (int trivial = 0; trivial < 2; ++trivial) {
        trial_.assign(in.size(), static_cast<uint8_t>(trivial));
        if (evaluate_plan(in, cost, trial_, scratch_) < out.makespan_s) {
            std::swap(out, scratch_);
            out.method = trivial ? "all_gpu" : "all_cpu";
        }
    }
}

void CpuUncachedScheduler::split(const LayerInput & in, const CostModel &, std::vector<uint8_t> & on_gpu) {
    on_gpu.assign(in.cached.begin(), in.cached.end());
}

void GpuOnDemandScheduler::split(const LayerInput & in, const CostModel &, std::vector<uint8_t> & on_gpu) {
    on_gpu.assign(in.size(), 1);
}

StaticLayerScheduler::StaticLayerScheduler(int n_cpu_layers) : n_cpu_layers_(n_cpu_layers) {
    if (n_cpu_layers < 0) {
        throw std::invalid_argument("StaticLayerScheduler: n_cpu_layers must be >= 0, got " +
                                    std::to_string(n_cpu_layers));
    }
}

void StaticLayerScheduler::split(const LayerInput & in, const CostModel &, std::vector<uint8_t> & on_gpu) {
    on_gpu.assign(in.size(), in.layer < n_cpu_layers_ ? 0 : 1);
}

ExhaustiveScheduler::ExhaustiveScheduler(int max_exhaustive) : max_exhaustive_(max_exhaustive) {
    if (max_exhaustive < 0 || max_exhaustive > 24) {
        throw std::invalid_argument("ExhaustiveScheduler: max_exhaustive must be in 0..24, got " +
                                    std::to_string(max_exhaustive));
    }
}

void ExhaustiveScheduler::split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) {
    plan(in, cost, scratch_);
    on_gpu = scratch_.on_gpu;
}

void ExhaustiveScheduler::plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out) {
    const size_t k = in.size();
    if (static_cast<int>(k) <= max_exhaustive_) {
        uint32_t best_mask = 0;
        double best = std::numeric_limits<double>::infinity();
        trial_.assign(k, 0);
        for (uint32_t mask = 0; mask < (1u << k); ++mask) {
            for (size_t i = 0; i < k; ++i) {
                trial_[i] = static_cast<uint8_t>((mask >> i) & 1u);
            }
            const double m = evaluate_plan(in, cost, trial_, scratch_);
            if (m < best) {
                best = m;
                best_mask = mask;
            }
        }
        for (size_t i = 0; i < k; ++i) {
            trial_[i] = static_cast<uint8_t>((best_mask >> i) & 1u);
        }
        evaluate_plan(in, cost, trial_, out);
        out.method = "exhaustive";
        return;
    }
    // Labelled local optimum: single flips from the HybriMoE plan until none improves (bounded passes).
    start_.plan(in, cost, out);
    trial_ = out.on_gpu;
    double best = out.makespan_s;
    for (int pass = 0; pass < 32; ++pass) {
        bool improved = false;
        for (size_t i = 0; i < k; ++i) {
            trial_[i] ^= 1u;
            const double m = evaluate_plan(in, cost, trial_, scratch_);
            if (m < best * (1.0 - 1e-12)) {
                best = m;
                improved = true;
            } else {
                trial_[i] ^= 1u;
            }
        }
        if (!improved) {
            break;
        }
    }
    evaluate_plan(in, cost, trial_, out);
    out.method = "local_search";
}

std::shared_ptr<SchedulePolicy> make_scheduler(const std::string & name, int n_cpu_layers) {
    if (name == "hybrimoe") return std::make_shared<HybriMoEScheduler>();
    if (name == "ktransformers") return std::make_shared<CpuUncachedScheduler>();
    if (name == "gpu-on-demand") return std::make_shared<GpuOnDemandScheduler>();
    if (name == "upstream-ncmoe") return std::make_shared<StaticLayerScheduler>(n_cpu_layers);
    if (name == "exhaustive") return std::make_shared<ExhaustiveScheduler>();
    throw std::invalid_argument("unknown scheduler '" + name +
                                "' (known: hybrimoe, ktransformers, gpu-on-demand, upstream-ncmoe, exhaustive)");
}

}  // namespace hybrimoe
