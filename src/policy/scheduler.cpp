#include "policy/scheduler.h"

#include <algorithm>
#include <cmath>
#include <array>
#include <functional>
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
    if (!on_disk.empty() && on_disk.size() != k) {
        throw std::invalid_argument("LayerInput: on_disk must be empty or have one entry per expert (got " +
                                    std::to_string(on_disk.size()) + " for " + std::to_string(k) + ")");
    }
    if (!(read_s >= 0.0) || !std::isfinite(read_s) || read_slots < 1) {
        throw std::invalid_argument("LayerInput: read_s must be finite and >= 0, read_slots >= 1");
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

bool LayerInput::has_disk() const {
    if (!(read_s > 0.0)) return false;
    for (uint8_t d : on_disk) {
        if (d) return true;
    }
    return false;
}

double LayerInput::reads_s(int n) const {
    if (n <= 0) return 0.0;
    const int slots = std::max(1, read_slots);
    return static_cast<double>((n + slots - 1) / slots) * read_s;
}

void LayerInput::set_routing(const int32_t * ids, int n_tokens_, int top_k, int n_experts) {
    if (n_tokens_ < 1 || top_k < 1 || n_experts < 1) {
        throw std::invalid_argument("set_routing: n_tokens, top_k and n_experts must be >= 1");
    }
    // One pass over the ids: pos[e] = index of expert e in first-appearance order (-1 until seen). experts and
    // loads are sized to n_experts up front and trimmed at the end, so the loop never grows a vector.
    thread_local std::vector<int32_t> pos;
    pos.assign(static_cast<size_t>(n_experts), -1);
    experts.resize(static_cast<size_t>(n_experts));
    loads.resize(static_cast<size_t>(n_experts));
    int32_t * ex = experts.data();
    int32_t * ld = loads.data();
    int32_t * ps = pos.data();
    int32_t k = 0;
    const int n_ids = n_tokens_ * top_k;
    for (int i = 0; i < n_ids; ++i) {
        const int32_t e = ids[i];
        if (static_cast<uint32_t>(e) >= static_cast<uint32_t>(n_experts)) {
            experts.clear();
            loads.clear();
            throw std::invalid_argument("set_routing: expert id " + std::to_string(e) + " at token " +
                                        std::to_string(i / top_k) + " is outside 0.." +
                                        std::to_string(n_experts - 1));
        }
        int32_t p = ps[e];
        if (p < 0) {
            p = ps[e] = k++;
            ex[p] = e;
            ld[p] = 0;
        }
        ++ld[p];
    }
    experts.resize(static_cast<size_t>(k));
    loads.resize(static_cast<size_t>(k));
    n_tokens = n_tokens_;
    cached.assign(experts.size(), 0);
    ready_s.assign(experts.size(), 0.0);
    on_disk.clear();
}

namespace {

// Set bits of x. __builtin_popcount is a libgcc call on the baseline x86-64 target (no POPCNT instruction) and
// best_mask asks it once per split; these shifts and adds are a few instructions inline.
inline int popcount32(uint32_t x) {
    x = x - ((x >> 1) & 0x55555555u);
    x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
    x = (x + (x >> 4)) & 0x0F0F0F0Fu;
    return static_cast<int>((x * 0x01010101u) >> 24);
}

// Indices 0..k-1 ordered by load descending, ties by expert id ascending (deterministic). Sorts (key, index)
// pairs whose 64-bit key encodes both criteria, so the comparison is one integer compare without indirection.
void order_by_load_desc(const LayerInput & in, std::vector<int32_t> & idx) {
    thread_local std::vector<std::pair<uint64_t, int32_t>> keyed;
    const size_t k = in.size();
    keyed.resize(k);
    for (size_t i = 0; i < k; ++i) {
        // Flipping the sign bit maps int32 order onto uint32 order (valid for any value, validated or not);
        // UINT32_MAX minus that turns load ascending into descending.
        const uint64_t hi = 0xFFFFFFFFull - (static_cast<uint32_t>(in.loads[i]) ^ 0x80000000u);
        const uint64_t lo = static_cast<uint32_t>(in.experts[i]) ^ 0x80000000u;
        keyed[i] = {(hi << 32) | lo, static_cast<int32_t>(i)};
    }
    std::sort(keyed.begin(), keyed.end(),
              [](const std::pair<uint64_t, int32_t> & a, const std::pair<uint64_t, int32_t> & b) {
                  return a.first < b.first;
              });
    idx.resize(k);
    for (size_t r = 0; r < k; ++r) idx[r] = keyed[r].second;
}

}  // namespace

void load_descending_order(const LayerInput & in, std::vector<int32_t> & idx) { order_by_load_desc(in, idx); }

namespace {

// evaluate_plan on a precomputed order `idx` (order_by_load_desc of `in`): plan() sorts once for its three
// evaluations and the greedy split.
double evaluate_ordered(const LayerInput & in, const CostModel & cost, const std::vector<uint8_t> & on_gpu,
                        const std::vector<int32_t> & idx, SchedulePlan & out);

}  // namespace

double evaluate_plan(const LayerInput & in, const CostModel & cost, const std::vector<uint8_t> & on_gpu,
                     SchedulePlan & out) {
    if (on_gpu.size() != in.size()) {
        throw std::invalid_argument("evaluate_plan: on_gpu has " + std::to_string(on_gpu.size()) +
                                    " entries for " + std::to_string(in.size()) + " activated experts");
    }
    thread_local std::vector<int32_t> idx;
    order_by_load_desc(in, idx);
    return evaluate_ordered(in, cost, on_gpu, idx, out);
}

namespace {

double evaluate_ordered(const LayerInput & in, const CostModel & cost, const std::vector<uint8_t> & on_gpu,
                        const std::vector<int32_t> & idx, SchedulePlan & out) {
    const size_t k = in.size();
    // the RAM tier's reads (evaluate_plan's documentation): the GPU's reads (of its uncached experts on disk) come
    // first, then the CPU's; without reads in the timeline every step below is the plain timeline's
    const bool disk = in.has_disk();
    int n_g = 0, n_c = 0;
    if (disk) {
        for (size_t i = 0; i < k; ++i) {
            if (!in.on_disk[i]) continue;
            if (!on_gpu[i]) {
                ++n_c;
            } else if (!in.cached[i]) {
                ++n_g;
            }
        }
    }
    const double gpu_reads = in.reads_s(n_g);
    // A GPU task: release time, rank r in idx (load-descending order), LayerInput index.
    struct Task {
        double ready;
        int32_t r;
        int32_t i;
    };
    thread_local std::vector<Task> cached_tasks, copied_tasks, gpu_tasks;
    if (&out.on_gpu != &on_gpu) {
        out.on_gpu = on_gpu;
    }
    out.cpu_experts.clear();
    out.gpu_experts.clear();
    out.load_experts.clear();
    cached_tasks.clear();
    copied_tasks.clear();

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
        if (n_c > 0) t_cpu += in.reads_s(n_g + n_c);  // the CPU share starts once every read ended
    }

    // Copies back to back, highest load first; GPU tasks released at their copy end. With reads, the experts in RAM
    // are copied first (pass 0), those read from disk once their reads ended (pass 1).
    double t_link = in.pcie_free_s;
    const double h2d = cost.h2d(in.expert_bytes);
    for (int pass = 0; pass < (n_g > 0 ? 2 : 1); ++pass) {
        if (pass == 1) t_link = std::max(t_link, gpu_reads);
        for (size_t r = 0; r < k; ++r) {
            const int32_t i = idx[r];
            if (!on_gpu[i] || (disk && (in.on_disk[i] != 0) != (pass == 1) && !in.cached[i])) {
                continue;
            }
            if (in.cached[i]) {
                if (pass == 0) cached_tasks.push_back({in.ready_s[i], static_cast<int32_t>(r), i});
            } else {
                t_link += h2d;
                out.load_experts.push_back(in.experts[i]);
                copied_tasks.push_back({t_link, static_cast<int32_t>(r), i});
            }
        }
    }
    // GPU order: earliest ready first, ties in idx order (highest load first), i.e. ascending (ready, r). Copied
    // tasks are in that order without reads (copy ends grow with r); cached ones usually are (all ready at 0), else
    // a stable sort by ready keeps r order among equals. Merging the two on (ready, r) gives that total order.
    auto earlier = [](const Task & a, const Task & b) { return a.ready < b.ready || (a.ready == b.ready && a.r < b.r); };
    if (!std::is_sorted(cached_tasks.begin(), cached_tasks.end(), earlier)) {
        std::stable_sort(cached_tasks.begin(), cached_tasks.end(),
                         [](const Task & a, const Task & b) { return a.ready < b.ready; });
    }
    if (!std::is_sorted(copied_tasks.begin(), copied_tasks.end(), earlier)) {
        std::stable_sort(copied_tasks.begin(), copied_tasks.end(), earlier);
    }
    gpu_tasks.resize(cached_tasks.size() + copied_tasks.size());
    std::merge(cached_tasks.begin(), cached_tasks.end(), copied_tasks.begin(), copied_tasks.end(), gpu_tasks.begin(),
               earlier);
    double t_gpu = 0.0;
    if (!gpu_tasks.empty()) {
        // a device that cannot compute while it copies (copy_overlap < 1) first works through the copy queue, this
        // layer's loads included (the engine queues them before its launches); the launch waits for the GPU's reads
        t_gpu = cost.copy_blocking(t_link);
        if (n_g > 0) t_gpu = std::max(t_gpu, gpu_reads);
        t_gpu += cost.act(in.n_tokens);
        for (const Task & task : gpu_tasks) {
            t_gpu = std::max(t_gpu, task.ready) + cost.gpu(in.loads[task.i]);
            out.gpu_experts.push_back(in.experts[task.i]);
        }
    }
    // the copies this plan queues delay the CPU share on a host that pays for them (cpu_copy_overlap < 1)
    if (!out.cpu_experts.empty()) t_cpu += cost.cpu_copy_blocking(t_link - in.pcie_free_s);
    out.cpu_end_s = t_cpu;
    out.gpu_end_s = t_gpu;
    out.pcie_end_s = t_link;
    out.makespan_s = std::max(t_cpu, t_gpu);
    return out.makespan_s;
}

}  // namespace

double MakespanEvaluator::disk_makespan(const uint8_t * on_rank) {
    const size_t k = index_.size();
    disk_split_.resize(k);
    for (size_t r = 0; r < k; ++r) disk_split_[index_[r]] = on_rank[r];
    return evaluate_ordered(disk_in_, disk_cost_, disk_split_, disk_desc_, disk_plan_);
}

void MakespanEvaluator::improve_split(std::vector<uint8_t> & on_gpu, double & best) {
    if (!disk_) return;
    const size_t k = on_gpu.size();
    for (size_t round = 0; round < k; ++round) {
        bool improved = false;
        for (size_t i = 0; i < k; ++i) {
            on_gpu[i] ^= 1;
            const double m = makespan(on_gpu.data());
            if (m < best) {
                best = m;
                improved = true;
            } else {
                on_gpu[i] ^= 1;
            }
        }
        if (!improved) break;
    }
}

void MakespanEvaluator::prepare(const LayerInput & in, const CostModel & cost, const std::vector<int32_t> & desc) {
    disk_ = in.has_disk();
    if (disk_) {
        disk_in_ = in;
        disk_cost_ = cost;
        disk_desc_.assign(desc.begin(), desc.begin() + static_cast<std::ptrdiff_t>(in.size()));
    }
    const size_t k = in.size();
    index_.assign(desc.begin(), desc.begin() + static_cast<std::ptrdiff_t>(k));
    rank_of_.resize(k);
    for (size_t r = 0; r < k; ++r) rank_of_[index_[r]] = static_cast<int32_t>(r);
    cpu_s_.resize(k);
    gpu_s_.resize(k);
    ready_rank_.resize(k);
    uncached_.clear();
    cached_desc_.clear();
    cached_order_.clear();
    gpu_min_s_ = std::numeric_limits<double>::infinity();
    uniform_costs_ = true;
    for (size_t r = 0; r < k; ++r) {
        const int32_t i = desc[r];
        cpu_s_[r] = cost.cpu(in.loads[i]);
        gpu_s_[r] = cost.gpu(in.loads[i]);
        gpu_min_s_ = std::min(gpu_min_s_, gpu_s_[r]);
        uniform_costs_ = uniform_costs_ && cpu_s_[r] == cpu_s_[0] && gpu_s_[r] == gpu_s_[0];
        ready_rank_[r] = in.ready_s[i];
        if (in.cached[i]) {
            cached_order_.push_back(static_cast<int32_t>(r));
        } else {
            uncached_.push_back(static_cast<int32_t>(r));
        }
    }
    cached_desc_.assign(cached_order_.rbegin(), cached_order_.rend());
    // evaluate_ordered runs the cached GPU tasks by (ready, rank): pushed in rank order, a stable sort by ready
    // gives that order (usually there already: all ready at 0), and any split's cached GPU tasks keep it
    auto by_ready = [&](int32_t a, int32_t b) { return in.ready_s[desc[a]] < in.ready_s[desc[b]]; };
    if (!std::is_sorted(cached_order_.begin(), cached_order_.end(), by_ready)) {
        std::stable_sort(cached_order_.begin(), cached_order_.end(), by_ready);
    }
    cached_ready_.resize(cached_order_.size());
    for (size_t j = 0; j < cached_order_.size(); ++j) cached_ready_[j] = in.ready_s[desc[cached_order_[j]]];
    on_rank_.resize(k);
    copy_end_.resize(k);
    copy_rank_.resize(k);
    pcie_free_s_ = in.pcie_free_s;
    h2d_s_ = cost.h2d(in.expert_bytes);
    act_s_ = cost.act(in.n_tokens);
    cpu_startup_s_ = cost.cpu_startup_s;
    copy_overlap_ = cost.copy_overlap;
    cpu_copy_overlap_ = cost.cpu_copy_overlap;
}

double MakespanEvaluator::makespan(const uint8_t * on_gpu) {
    const size_t k = index_.size();
    for (size_t r = 0; r < k; ++r) on_rank_[r] = on_gpu[index_[r]] != 0;
    return makespan_ranked();
}

double MakespanEvaluator::makespan_mask(uint32_t mask) {
    const size_t k = index_.size();
    for (size_t r = 0; r < k; ++r) on_rank_[r] = static_cast<uint8_t>((mask >> index_[r]) & 1u);
    return makespan_ranked();
}

uint32_t MakespanEvaluator::best_mask(double & best) {
    const int k = static_cast<int>(index_.size());
    if (k > kMaxMaskSearch) throw std::invalid_argument("MakespanEvaluator.best_mask: too many experts");
    const uint32_t n_masks = 1u << k;
    // the CPU queue of makespan_ranked: uncached ranks from the highest down, then the cached ones likewise;
    // queue position q of each LayerInput index, and the CPU sum of every set of positions in queue order
    // (sum(S) = sum(S without its last position) + that position's cost, the queue's own additions)
    std::array<uint32_t, kMaxMaskSearch> qbit{};
    std::array<double, kMaxMaskSearch> qcost{};
    int q = 0;
    for (size_t j = uncached_.size(); j-- > 0; ++q) {
        qbit[index_[uncached_[j]]] = 1u << q;
        qcost[q] = cpu_s_[uncached_[j]];
    }
    for (int32_t r : cached_desc_) {
        qbit[index_[r]] = 1u << q;
        qcost[q] = cpu_s_[r];
        ++q;
    }
    cpu_sum_.resize(n_masks);
    queue_set_.resize(n_masks);
    cpu_sum_[0] = 0.0;
    queue_set_[0] = 0;
    uint32_t unc_bits = 0;
    for (int32_t r : uncached_) unc_bits |= 1u << index_[r];
    for (uint32_t m = 1; m < n_masks; ++m) {
        int hb = 31 - __builtin_clz(m);
        cpu_sum_[m] = cpu_sum_[m ^ (1u << hb)] + qcost[hb];
        queue_set_[m] = queue_set_[m & (m - 1)] | qbit[__builtin_ctz(m)];
    }
    // the copy queue after n copies (makespan_ranked's repeated additions) and the cheapest GPU task
    std::array<double, kMaxMaskSearch + 1> link{};
    link[0] = pcie_free_s_;
    for (int n = 1; n <= k; ++n) link[n] = link[n - 1] + h2d_s_;
    double g_min = std::numeric_limits<double>::infinity();
    for (double g : gpu_s_) g_min = std::min(g_min, g);
    const uint32_t all = n_masks - 1;
    best = std::numeric_limits<double>::infinity();
    uint32_t best_m = 0;
    for (uint32_t m = 0; m < n_masks; ++m) {
        const uint32_t cpu = all & ~m;
        const int n_copied = popcount32(m & unc_bits);
        // makespan >= the CPU end (exactly as makespan_ranked computes it) and >= the GPU end, which is no less
        // than its start plus one task, nor than the last copy's end plus one task (every step there is a max and
        // an addition of nonnegative numbers: monotone in floating point too)
        double bound = 0.0;
        if (cpu) {
            bound = (cpu_sum_[queue_set_[cpu]] + cpu_startup_s_) +
                    (1.0 - cpu_copy_overlap_) * (link[n_copied] - pcie_free_s_);
        }
        if (m) {
            const double start = (1.0 - copy_overlap_) * link[n_copied] + act_s_;
            bound = std::max(bound, start + g_min);
            if (n_copied > 0) bound = std::max(bound, link[n_copied] + g_min);
        }
        if (!(bound < best)) continue;
        const double v = makespan_mask(m);
        if (v < best) {
            best = v;
            best_m = m;
        }
    }
    return best_m;
}

double MakespanEvaluator::makespan_ranked() {
    if (disk_) return disk_makespan(on_rank_.data());
    // evaluate_ordered's arithmetic, operation for operation (see there for what each step models)
    const uint8_t * on = on_rank_.data();
    // CPU queue: uncached lowest load first (ranks descending), then cached lowest load first
    double t_cpu = 0.0;
    bool any_cpu = false;
    for (size_t j = uncached_.size(); j-- > 0;) {
        const int32_t r = uncached_[j];
        if (!on[r]) {
            t_cpu += cpu_s_[r];
            any_cpu = true;
        }
    }
    for (int32_t r : cached_desc_) {
        if (!on[r]) {
            t_cpu += cpu_s_[r];
            any_cpu = true;
        }
    }
    if (any_cpu) t_cpu += cpu_startup_s_;
    // copies back to back, highest load first
    double t_link = pcie_free_s_;
    const double h2d = h2d_s_;
    int n_copied = 0;
    for (int32_t r : uncached_) {
        if (on[r]) {
            t_link += h2d;
            copy_end_[n_copied] = t_link;
            copy_rank_[n_copied] = r;
            ++n_copied;
        }
    }
    bool any_gpu = n_copied > 0;
    for (size_t j = 0; j < cached_order_.size() && !any_gpu; ++j) any_gpu = on[cached_order_[j]] != 0;
    double t_gpu = 0.0;
    if (any_gpu) {
        t_gpu = (1.0 - copy_overlap_) * t_link + act_s_;
        // std::merge of the cached tasks (the first range) with the copied ones on (ready, rank): a copied task
        // goes first only when strictly earlier
        const size_t n_cached = cached_order_.size();
        size_t a = 0;
        int b = 0;
        for (;;) {
            while (a < n_cached && !on[cached_order_[a]]) ++a;
            if (a == n_cached) {
                for (; b < n_copied; ++b) t_gpu = std::max(t_gpu, copy_end_[b]) + gpu_s_[copy_rank_[b]];
                break;
            }
            if (b < n_copied && (copy_end_[b] < cached_ready_[a] ||
                                 (copy_end_[b] == cached_ready_[a] && copy_rank_[b] < cached_order_[a]))) {
                t_gpu = std::max(t_gpu, copy_end_[b]) + gpu_s_[copy_rank_[b]];
                ++b;
            } else {
                t_gpu = std::max(t_gpu, cached_ready_[a]) + gpu_s_[cached_order_[a]];
                ++a;
            }
        }
    }
    if (any_cpu) t_cpu += (1.0 - cpu_copy_overlap_) * (t_link - pcie_free_s_);
    return std::max(t_cpu, t_gpu);
}

std::vector<uint8_t> assign_pairs(const LayerInput & in, const SchedulePlan & plan, const int32_t * ids,
                                  int n_tokens, int top_k) {
    if (plan.on_gpu.size() != in.size()) {
        throw std::invalid_argument("assign_pairs: plan does not match the layer input");
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
            throw std::invalid_argument("assign_pairs: expert " + std::to_string(e) + " of token " +
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
    order_by_load_desc(in, by_load_desc_);
    greedy_ordered(in, cost, by_load_desc_, on_gpu);
}

void HybriMoEScheduler::greedy_ordered(const LayerInput & in, const CostModel & cost,
                                       const std::vector<int32_t> & desc, std::vector<uint8_t> & on_gpu) {
    eval_.prepare(in, cost, desc);
    eval_.greedy();
    eval_.split_by_input(on_gpu);
}

void MakespanEvaluator::split_by_input(std::vector<uint8_t> & on_gpu) const {
    const size_t k = index_.size();
    on_gpu.assign(k, 0);
    for (size_t r = 0; r < k; ++r) on_gpu[index_[r]] = on_rank_[r];
}

void MakespanEvaluator::greedy() {
    // HybriMoE §IV.B's greedy over the prepared ranks: at each step the queue (CPU, a cached GPU task, a copy and
    // its GPU task) that would finish its next expert earliest takes it. The CPU takes the lowest load of the
    // uncached experts (then of the cached ones), the GPU the highest cached load, the link the highest uncached
    // load, so what is left of each kind is a contiguous range of its list: uncached_ (highest load first) and
    // cached_desc_ (lowest load first), each consumed from both ends. The costs are prepare()'s.
    // Members are read into locals first: the split is written through a uint8_t pointer, which may alias them.
    uint8_t * on = on_rank_.data();
    std::fill(on_rank_.begin(), on_rank_.end(), 0);
    const int32_t * unc = uncached_.data();
    const int32_t * cac = cached_desc_.data();
    const double * cpu_s = cpu_s_.data();
    const double * gpu_s = gpu_s_.data();
    const double * ready = ready_rank_.data();
    int u_begin = 0, u_end = static_cast<int>(uncached_.size());     // uncached left: [u_begin, u_end)
    int c_begin = 0, c_end = static_cast<int>(cached_desc_.size());  // cached left: [c_begin, c_end)

    const double inf = std::numeric_limits<double>::infinity();
    const double h2d = h2d_s_;
    const double gpu_start = act_s_;
    const double pcie_free = pcie_free_s_;
    const double startup = cpu_startup_s_;
    const double co1 = 1.0 - copy_overlap_, cco1 = 1.0 - cpu_copy_overlap_;
    const bool cpu_pays = cpu_copy_overlap_ < 1.0;
    double t_cpu = 0.0, t_gpu = 0.0, t_link = pcie_free;
    bool cpu_started = false, gpu_started = false;
    // terms that change only when a copy is queued (t_link moves)
    double link_gpu = co1 * t_link + gpu_start;
    double cpu_block = cco1 * (t_link - pcie_free);
    // The GPU's and the link's candidates (g, p, f_gpu, the copy's finish before its CPU term) change only when the
    // GPU or the link takes a task, or a range they read runs empty: kept until then (the same numbers).
    bool gpu_side_changed = true;
    int g = -1, p = -1;
    double f_gpu = inf, f_pcie_gpu = inf, copy_end = 0.0;

    while (u_begin < u_end || c_begin < c_end) {
        const bool any_unc = u_begin < u_end, any_cac = c_begin < c_end;
        // ranks (-1: none left): the CPU's next, a cached GPU task, a copy
        const int c = any_unc ? unc[u_end - 1] : cac[c_begin];
        if (gpu_side_changed) {
            g = any_cac ? cac[c_end - 1] : -1;
            p = any_unc ? unc[u_begin] : -1;
            // the copy queue (so far) delays the GPU on a device that cannot compute while it copies
            const double gpu_base = std::max(gpu_started ? t_gpu : gpu_start, link_gpu);
            f_gpu = g >= 0 ? std::max(gpu_base, ready[g]) + gpu_s[g] : inf;
            copy_end = t_link + h2d;
            f_pcie_gpu = p >= 0 ? std::max(gpu_base, copy_end) + gpu_s[p] : inf;
            gpu_side_changed = false;
        }
        // the CPU's work so far plus what this layer's copies so far cost it (cpu_copy_overlap < 1)
        const double f_cpu = t_cpu + cpu_block + (cpu_started ? 0.0 : startup) + cpu_s[c];
        double f_pcie = f_pcie_gpu;
        // a copy that costs the CPU time is judged by the later of the two ends it makes
        if (p >= 0 && cpu_started && cpu_pays) {
            f_pcie = std::max(f_pcie, t_cpu + cpu_block + cco1 * h2d);
        }

        // Ties: a cached GPU task first (no copy), then the CPU, then a copy.
        if (f_gpu <= f_cpu && f_gpu <= f_pcie) {
            t_gpu = f_gpu;
            gpu_started = true;
            on[g] = 1;
            --c_end;
            gpu_side_changed = true;
        } else if (f_cpu <= f_pcie) {
            t_cpu = f_cpu - cpu_block;
            cpu_started = true;
            if (any_unc) {
                --u_end;
                gpu_side_changed = u_end == u_begin;  // no copy left (p), and the CPU turns to the cached
            } else {
                ++c_begin;
                gpu_side_changed = c_begin == c_end;  // no cached task left (g)
            }
        } else {
            t_link = copy_end;
            link_gpu = co1 * t_link + gpu_start;
            cpu_block = cco1 * (t_link - pcie_free);
            t_gpu = f_pcie;
            gpu_started = true;
            on[p] = 1;
            ++u_begin;
            gpu_side_changed = true;
        }
    }
}

double MakespanEvaluator::best_of_greedy_and_trivial() {
    // plan()'s three candidates, makespans only: the same first minimum (strictly shorter replaces)
    greedy();
    double best = makespan_ranked();
    int pick = -1;  // -1 the greedy split, 0 all-CPU, 1 all-GPU
    const double cpu = makespan_all_cpu();
    if (cpu < best) {
        best = cpu;
        pick = 0;
    }
    // the all-GPU plan ends no sooner than its last copy plus one task (see makespan_all_gpu_bound): when that is
    // not shorter than the best so far, it cannot be chosen and is not evaluated
    if (makespan_all_gpu_bound() < best) {
        const double gpu = makespan_all_gpu();
        if (gpu < best) {
            best = gpu;
            pick = 1;
        }
    }
    if (disk_) {  // plan()'s local search from the split it chose
        std::vector<uint8_t> split;
        if (pick < 0) {
            split_by_input(split);
        } else {
            split.assign(index_.size(), static_cast<uint8_t>(pick));
        }
        improve_split(split, best);
    }
    return best;
}

double MakespanEvaluator::makespan_all_gpu_bound() const {
    // makespan_all_gpu() starts the GPU at (1 - copy_overlap) * the copy queue's end + act and runs every task
    // after its release: its end is at least that start plus the cheapest task and, with copies, the last copy's end
    // plus the cheapest task (maxima and additions of nonnegative numbers: monotone in floating point too)
    if (uncached_.empty() && cached_order_.empty()) return 0.0;
    double t_link = pcie_free_s_;
    for (size_t j = 0; j < uncached_.size(); ++j) t_link += h2d_s_;
    double bound = (1.0 - copy_overlap_) * t_link + act_s_ + gpu_min_s_;
    if (!uncached_.empty()) bound = std::max(bound, t_link + gpu_min_s_);
    return bound;
}

double MakespanEvaluator::makespan_all_cpu() {
    if (disk_) {
        disk_split_.assign(index_.size(), 0);
        return evaluate_ordered(disk_in_, disk_cost_, disk_split_, disk_desc_, disk_plan_);
    }
    // makespan_ranked() with every rank on the CPU: the CPU queue only (nothing is copied, the GPU stays idle)
    double t_cpu = 0.0;
    for (size_t j = uncached_.size(); j-- > 0;) t_cpu += cpu_s_[uncached_[j]];
    for (int32_t r : cached_desc_) t_cpu += cpu_s_[r];
    if (uncached_.empty() && cached_desc_.empty()) return 0.0;
    t_cpu += cpu_startup_s_;
    t_cpu += (1.0 - cpu_copy_overlap_) * (pcie_free_s_ - pcie_free_s_);  // no copies: as makespan_ranked adds it
    return std::max(t_cpu, 0.0);
}

double MakespanEvaluator::makespan_all_gpu() {
    if (disk_) {
        disk_split_.assign(index_.size(), 1);
        return evaluate_ordered(disk_in_, disk_cost_, disk_split_, disk_desc_, disk_plan_);
    }
    // makespan_ranked() with every rank on the GPU: every uncached expert copied, all merged by (ready, rank)
    double t_link = pcie_free_s_;
    int n_copied = 0;
    for (int32_t r : uncached_) {
        t_link += h2d_s_;
        copy_end_[n_copied] = t_link;
        copy_rank_[n_copied] = r;
        ++n_copied;
    }
    const size_t n_cached = cached_order_.size();
    if (n_copied == 0 && n_cached == 0) return 0.0;
    double t_gpu = (1.0 - copy_overlap_) * t_link + act_s_;
    size_t a = 0;
    int b = 0;
    while (a < n_cached) {
        if (b < n_copied &&
            (copy_end_[b] < cached_ready_[a] || (copy_end_[b] == cached_ready_[a] && copy_rank_[b] < cached_order_[a]))) {
            t_gpu = std::max(t_gpu, copy_end_[b]) + gpu_s_[copy_rank_[b]];
            ++b;
        } else {
            t_gpu = std::max(t_gpu, cached_ready_[a]) + gpu_s_[cached_order_[a]];
            ++a;
        }
    }
    for (; b < n_copied; ++b) t_gpu = std::max(t_gpu, copy_end_[b]) + gpu_s_[copy_rank_[b]];
    return std::max(0.0, t_gpu);
}

namespace {

// v.insert(v.begin() + pos, x) and v.erase(v.begin() + pos) for the evaluator's short lists (a few elements: a plain
// loop is cheaper than a memmove call).
template <typename T>
void insert_at(std::vector<T> & v, size_t pos, T x) {
    const size_t n = v.size();
    v.push_back(x);
    T * d = v.data();
    for (size_t j = n; j > pos; --j) d[j] = d[j - 1];
    d[pos] = x;
}

template <typename T>
void erase_at(std::vector<T> & v, size_t pos) {
    T * d = v.data();
    const size_t n = v.size();
    for (size_t j = pos; j + 1 < n; ++j) d[j] = d[j + 1];
    v.pop_back();
}

}  // namespace

MakespanEvaluator::CacheChange MakespanEvaluator::apply_cached(int32_t i, double ready_s, double pcie_free_s) {
    CacheChange c;
    c.r = rank_of_[static_cast<size_t>(i)];
    const auto u = std::lower_bound(uncached_.begin(), uncached_.end(), c.r);
    if (u == uncached_.end() || *u != c.r) {
        throw std::logic_error("MakespanEvaluator: input index " + std::to_string(i) + " is cached already");
    }
    c.unc = static_cast<size_t>(u - uncached_.begin());
    erase_at(uncached_, c.unc);
    // cached_desc_: ranks descending
    size_t d = 0;
    while (d < cached_desc_.size() && cached_desc_[d] > c.r) ++d;
    c.desc = d;
    insert_at(cached_desc_, d, c.r);
    // cached_order_: (ready, rank) ascending, the order prepare()'s stable sort by ready leaves rank-ordered ranks in
    size_t o = 0;
    while (o < cached_order_.size() &&
           (cached_ready_[o] < ready_s || (cached_ready_[o] == ready_s && cached_order_[o] < c.r))) {
        ++o;
    }
    c.order = o;
    insert_at(cached_order_, o, c.r);
    insert_at(cached_ready_, o, ready_s);
    c.ready = ready_rank_[c.r];
    ready_rank_[c.r] = ready_s;
    c.pcie_free = pcie_free_s_;
    pcie_free_s_ = pcie_free_s;
    if (disk_) {
        disk_in_.cached[static_cast<size_t>(i)] = 1;
        disk_in_.ready_s[static_cast<size_t>(i)] = ready_s;
        disk_in_.pcie_free_s = pcie_free_s;
    }
    return c;
}

void MakespanEvaluator::undo(const CacheChange & c) {
    if (disk_) {
        const size_t i = static_cast<size_t>(index_[static_cast<size_t>(c.r)]);
        disk_in_.cached[i] = 0;
        disk_in_.ready_s[i] = c.ready;
        disk_in_.pcie_free_s = c.pcie_free;
    }
    pcie_free_s_ = c.pcie_free;
    ready_rank_[c.r] = c.ready;
    erase_at(cached_ready_, c.order);
    erase_at(cached_order_, c.order);
    erase_at(cached_desc_, c.desc);
    insert_at(uncached_, c.unc, c.r);
}

double MakespanEvaluator::best_with_cached(int32_t i, double ready_s, double pcie_free_s) {
    const CacheChange c = apply_cached(i, ready_s, pcie_free_s);
    const double m = best_of_greedy_and_trivial();
    undo(c);
    return m;
}

void MakespanEvaluator::set_cached(int32_t i, double ready_s, double pcie_free_s) {
    apply_cached(i, ready_s, pcie_free_s);
}

int32_t MakespanEvaluator::equal_result_key(int32_t i) const {
    if (!uniform_costs_ || disk_) return -1;  // with the disk, which experts are on it tells them apart
    // apply_cached's position of the rank in cached_desc_ (ranks descending)
    const int32_t r = rank_of_[static_cast<size_t>(i)];
    int32_t above = 0;
    while (above < static_cast<int32_t>(cached_desc_.size()) && cached_desc_[above] > r) ++above;
    return above;
}

void HybriMoEScheduler::split(const LayerInput & in, const CostModel & cost, std::vector<uint8_t> & on_gpu) {
    plan(in, cost, scratch_);
    on_gpu = scratch_.on_gpu;
}

void HybriMoEScheduler::plan(const LayerInput & in, const CostModel & cost, SchedulePlan & out) {
    // One sort and one preparation serve the greedy split and all three evaluations.
    order_by_load_desc(in, by_load_desc_);
    eval_.prepare(in, cost, by_load_desc_);
    eval_.greedy();
    eval_.split_by_input(trial_);
    evaluate_ordered(in, cost, trial_, by_load_desc_, out);
    out.method = "greedy";
    // Documented improvement over the paper: never worse than either trivial plan. The trivial plans' makespans
    // come from the evaluator; the plan is built only for one that wins (strictly shorter, as before).
    for (int trivial = 0; trivial < 2; ++trivial) {
        trial_.assign(in.size(), static_cast<uint8_t>(trivial));
        if (eval_.makespan(trial_.data()) < out.makespan_s) {
            evaluate_ordered(in, cost, trial_, by_load_desc_, out);
            out.method = trivial ? "all_gpu" : "all_cpu";
        }
    }
    // the RAM tier's reads (LayerInput::on_disk): the greedy does not see them, a local search on the full
    // timeline does
    if (eval_.has_disk()) {
        trial_ = out.on_gpu;
        double best = out.makespan_s;
        eval_.improve_split(trial_, best);
        if (best < out.makespan_s) {
            evaluate_ordered(in, cost, trial_, by_load_desc_, out);
            out.method += "+reads";
        }
    }
}

double HybriMoEScheduler::makespan(const LayerInput & in, const CostModel & cost) {
    order_by_load_desc(in, by_load_desc_);
    return makespan(in, cost, by_load_desc_);
}

double HybriMoEScheduler::makespan(const LayerInput & in, const CostModel & cost, const std::vector<int32_t> & desc) {
    eval_.prepare(in, cost, desc);
    return eval_.best_of_greedy_and_trivial();
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
    order_by_load_desc(in, order_);  // one sort for every evaluation below
    if (static_cast<int>(k) <= max_exhaustive_) {
        uint32_t best_mask = 0;
        double best = std::numeric_limits<double>::infinity();
        trial_.assign(k, 0);
        eval_.prepare(in, cost, order_);
        if (static_cast<int>(k) <= MakespanEvaluator::kMaxMaskSearch) {
            best_mask = eval_.best_mask(best);  // the same first minimum, without evaluating hopeless masks
        } else {
            for (uint32_t mask = 0; mask < (1u << k); ++mask) {
                const double m = eval_.makespan_mask(mask);
                if (m < best) {
                    best = m;
                    best_mask = mask;
                }
            }
        }
        for (size_t i = 0; i < k; ++i) {
            trial_[i] = static_cast<uint8_t>((best_mask >> i) & 1u);
        }
        evaluate_ordered(in, cost, trial_, order_, out);
        out.method = "exhaustive";
        return;
    }
    // Labelled local optimum: single flips from the HybriMoE plan until none improves (bounded passes).
    start_.plan(in, cost, out);
    trial_ = out.on_gpu;
    double best = out.makespan_s;
    eval_.prepare(in, cost, order_);
    for (int pass = 0; pass < 32; ++pass) {
        bool improved = false;
        for (size_t i = 0; i < k; ++i) {
            trial_[i] ^= 1u;
            const double m = eval_.makespan(trial_.data());
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
    evaluate_ordered(in, cost, trial_, order_, out);
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
