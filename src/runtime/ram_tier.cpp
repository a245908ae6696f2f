#include "runtime/ram_tier.h"

#include "policy/router_predictor.h"
#include "runtime/cpu_layout.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

namespace hybrimoe {

namespace {

// the largest page-cache folio (a PMD: 2 MiB on x86-64 and arm64 with 4 KiB pages)
constexpr int64_t kDropGranule = 2 << 20;

// Advises MADV_RANDOM on every mapping of the file (device, inode) in this process (/proc/self/maps): the loader's
// (llama_mmap) above all. The weights outside the experts were pre-read at load (WILLNEED), but a page fault on one
// that is no longer in the page cache is answered by the kernel with a read-around of read_ahead_kb (often MiBs)
// centred on it, across the neighbouring expert tensors' pages, whatever advice those ranges carry; random advice on
// the whole mapping reads the faulting page only. Returns the bytes advised.
int64_t advise_mappings_random(dev_t dev, ino_t ino) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    int64_t advised = 0;
    while (std::getline(maps, line)) {
        // "lo-hi perms offset major:minor inode path"
        std::istringstream in(line);
        std::string range, perms, offset, devs;
        unsigned long long inode = 0;
        if (!(in >> range >> perms >> offset >> devs >> inode) || inode != (unsigned long long) ino) continue;
        const size_t colon = devs.find(':');
        if (colon == std::string::npos) continue;
        const unsigned maj = (unsigned) std::stoul(devs.substr(0, colon), nullptr, 16);
        const unsigned min = (unsigned) std::stoul(devs.substr(colon + 1), nullptr, 16);
        if (makedev(maj, min) != dev) continue;
        const size_t dash = range.find('-');
        const uintptr_t lo = (uintptr_t) std::stoull(range.substr(0, dash), nullptr, 16);
        const uintptr_t hi = (uintptr_t) std::stoull(range.substr(dash + 1), nullptr, 16);
        if (hi > lo && madvise((void *) lo, hi - lo, MADV_RANDOM) == 0) advised += (int64_t) (hi - lo);
    }
    return advised;
}

}  // namespace

RamTier::RamTier(int n_layers, int n_expert, const std::vector<std::array<int64_t, 3>> & expert_bytes,
                 const std::vector<std::array<int32_t, 3>> & expert_types,
                 const std::vector<std::array<int64_t, 3>> & bias_bytes,
                 const std::vector<std::array<int64_t, 3>> & scale_bytes, const ExpertFiles & where,
                 RamTierConfig cfg, std::shared_ptr<ExpertCache> cache, ggml_backend_buffer_type_t buft)
    : n_layers_(n_layers), n_expert_(n_expert), expert_bytes_(expert_bytes), where_(where), cfg_(std::move(cfg)),
      cache_(std::move(cache)),
      pool_(n_layers, n_expert, expert_bytes, expert_types, bias_bytes, scale_bytes, kDirectAlign) {
    const size_t L = (size_t) n_layers_;
    if (cfg_.n_slots < 1) throw std::invalid_argument("RAM tier: at least one RAM expert slot is needed");
    if (!cache_ || cache_->n_layers() != n_layers_ || cache_->n_experts() != n_expert_) {
        throw std::invalid_argument("RAM tier: the RAM cache must have the model's MoE layers and experts");
    }
    where_.validate(expert_bytes_, n_expert_, "RAM tier");
    if (cfg_.io_threads < 1 || cfg_.io_threads > 256) {
        throw std::invalid_argument("RAM tier: io_threads must be in 1..256, got " + std::to_string(cfg_.io_threads));
    }
    for (size_t f = 0; f < where_.files.size(); ++f) {
        const std::string & path = where_.files[f];
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            const int err = errno;
            close_files();
            throw std::runtime_error("RAM tier: cannot open " + path + ": " + std::strerror(err));
        }
        fds_.push_back(fd);
        struct stat st {};
        const std::string changed = where_.change(f, fds_[f], st);
        if (!changed.empty()) {
            close_files();
            throw std::runtime_error("RAM tier: " + path + " changed: " + changed + "; load the model again");
        }
        // the reads are the router's choice, not sequential: no kernel readahead around them, nor around the
        // loader's page faults on its mapping of the file
        posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
        advise_mappings_random(st.st_dev, st.st_ino);
        direct_fds_.push_back(cfg_.direct_io ? ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT) : -1);
    }
    for (const auto & eb : expert_bytes_) {
        for (int64_t b : eb) staging_bytes_ = std::max(staging_bytes_, b + 2 * kDirectAlign);
    }
    try {
        pool_.open_host(buft ? buft : ggml_backend_cpu_buffer_type(), cfg_.n_slots, cfg_.max_buffer_bytes);
    } catch (...) {
        close_files();
        throw;
    }
    drop_expert_pages();
    phase_.assign(L, {0, 0, 0});
    into_slot_.assign(L, {false, false, false});
    for (size_t l = 0; l < L; ++l) {
        for (size_t i = 0; i < 3; ++i) {
            const int64_t n = expert_bytes_[l][i];
            if (where_.file_of[l][i] < 0 || n <= 0 || n % kDirectAlign != 0) continue;
            phase_[l][i] = where_.offset_of[l][i] % kDirectAlign;
            into_slot_[l][i] = pool_.direct_aligned() && direct_fds_[(size_t) where_.file_of[l][i]] >= 0;
        }
    }
    const size_t keys = L * (size_t) n_expert_;
    state_.assign(keys, 0);
    key_error_.assign(keys, std::string());
    prefetched_.assign(keys, 0);
    pin_count_.assign(keys, 0);
    layers_.resize(L);
    repack_.assign(L, {false, false, false});
    if (cfg_.repack) repack_marker_ = new_repack_marker();  // none: nothing is repacked (no CPU_REPACK here)
    pins_.resize(L);
    prefetch_pins_.resize(L);
    cache_->set_record_evicted(true);
    cache_->take_evicted();
    for (int i = 0; i < cfg_.io_threads; ++i) workers_.emplace_back(&RamTier::worker, this);
}

void RamTier::drop_expert_pages() {
    if (!cfg_.drop_after_read) return;
    // Expert pages already in the page cache (the kernel's read-around of an earlier read of the file's header or of
    // a neighbouring tensor, e.g. the loader uploading the weights next to the experts to a device) leave it: they
    // are not meant to be in RAM there, and one of them may carry a read-ahead mark, whose first read would start an
    // asynchronous read-ahead of the next megabytes of experts. Pages still being read, or mapped by the loader's
    // fault-around, stay: the first ubatch drops them again (acquire).
    for (size_t l = 0; l < (size_t) n_layers_; ++l) {
        for (int i = 0; i < 3; ++i) {
            const int32_t f = where_.file_of[l][(size_t) i];
            if (f < 0) continue;
            posix_fadvise(fds_[(size_t) f], (off_t) where_.offset_of[l][(size_t) i],
                          (off_t) (expert_bytes_[l][(size_t) i] * n_expert_), POSIX_FADV_DONTNEED);
        }
    }
}

RamTier::~RamTier() {
    stop_io();
    close_files();
    if (repack_marker_) ggml_backend_buffer_free(repack_marker_);
}

void RamTier::close_files() {
    for (int fd : fds_) ::close(fd);
    for (int fd : direct_fds_) {
        if (fd >= 0) ::close(fd);
    }
    fds_.clear();
    direct_fds_.clear();
}

void RamTier::stop_io() {
    std::vector<int64_t> dropped;
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
        for (const Job & j : queue_) {
            state_[(size_t) j.key] = 0;
            key_error_[(size_t) j.key] = "the engine was released before this read ran";
            dropped.push_back(j.key);
        }
        queue_.clear();
        done_.insert(done_.end(), dropped.begin(), dropped.end());
    }
    cv_work_.notify_all();
    for (auto & t : workers_) t.join();
    workers_.clear();
    cv_done_.notify_all();
}

ExpertMatrices RamTier::views(ggml_context * ctx, int layer, const ExpertMatrices & m, int b) const {
    ExpertMatrices v = m;
    ggml_tensor ** mats[3] = {m.gate_up ? &v.gate_up : &v.gate, &v.up, &v.down};
    ggml_tensor ** biases[3] = {m.gate_up ? &v.gate_up_b : &v.gate_b, &v.up_b, &v.down_b};
    for (int i = 0; i < 3; ++i) {
        if (*mats[i]) {
            *mats[i] = pool_.region_view(ctx, *mats[i], i, b, phase_[(size_t) layer][(size_t) i]);
            if (repacked(layer, i)) {
                // the slots hold this region repacked: the view names the marker buffer and gets its traits, so
                // mul_mat_id runs repack.cpp's kernels on the slot's bytes
                (*mats[i])->buffer = repack_marker_;
                if (ggml_backend_buffer_init_tensor(repack_marker_, *mats[i]) != GGML_STATUS_SUCCESS ||
                    (*mats[i])->extra == nullptr) {
                    throw std::runtime_error("RAM tier: ggml-cpu did not take a repacked view of its slots");
                }
            }
        }
        if (*biases[i]) *biases[i] = pool_.bias_view(ctx, *biases[i], i, b);
    }
    return v;
}

void RamTier::pin(int64_t key) {
    cache_->pin((int) (key / n_expert_), (int) (key % n_expert_));
    if (pin_count_[(size_t) key]++ == 0) ++n_pinned_;
}

void RamTier::unpin(int64_t key) {
    cache_->unpin((int) (key / n_expert_), (int) (key % n_expert_));
    if (--pin_count_[(size_t) key] == 0) --n_pinned_;
}

void RamTier::drop_evicted() {
    for (int64_t key : cache_->take_evicted()) {
        pool_.evict(key);
        std::lock_guard<std::mutex> lock(mu_);
        state_[(size_t) key] = 0;
        prefetched_[(size_t) key] = 0;
        std::lock_guard<std::mutex> slock(stats_mu_);
        stats_.evictions += 1;
    }
}

bool RamTier::start_read(int layer, int expert, uint8_t tag, double now_s, bool certain) {
    const bool prefetch = tag != 0;
    const int64_t key = (int64_t) layer * n_expert_ + expert;
    if (workers_.empty()) throw std::runtime_error("RAM tier: the engine was released: no more reads");
    if (!cache_->resident(layer, expert)) {
        if (!cache_->admit(layer, expert, now_s, prefetch, !prefetch || certain)) return false;
        drop_evicted();
    }
    if (!pool_.assign(layer, expert)) {
        throw std::logic_error("RAM tier: the cache admitted MoE layer " + std::to_string(layer) + " expert " +
                               std::to_string(expert) + " but no RAM slot is free (slot bookkeeping)");
    }
    pin(key);  // until its read is harvested: an expert being read is never evicted
    const auto & eb = expert_bytes_[(size_t) layer];
    const double bytes = (double) (eb[0] + eb[1] + eb[2]);
    {
        std::lock_guard<std::mutex> lock(mu_);
        state_[(size_t) key] = 1;
        key_error_[(size_t) key].clear();
        prefetched_[(size_t) key] = tag;
        const Job j{key, pool_.slot_of(layer, expert), prefetch};
        // a demand read goes before every queued prefetch (the layer computing now waits for it), after the
        // demand reads queued before it (the plan op issues the reads it waits for first, first)
        if (prefetch) {
            queue_.push_back(j);
        } else {
            auto it = queue_.begin();
            while (it != queue_.end() && !it->prefetch) ++it;
            queue_.insert(it, j);
        }
    }
    cv_work_.notify_one();
    std::lock_guard<std::mutex> slock(stats_mu_);
    (prefetch ? stats_.prefetch_reads : stats_.demand_reads) += 1;
    (prefetch ? stats_.bytes_prefetch : stats_.bytes_demand) += bytes;
    return true;
}

namespace {

// A worker's staging buffer for O_DIRECT reads, on transparent huge pages where the kernel gives them. A direct
// read's bytes go by DMA into the buffer, one scatter-gather segment per physically contiguous run of its pages,
// and the block layer splits a read into requests of at most max_segments segments (254 on this project's virtio
// disk). On 4 KiB pages scattered in physical memory a 2 MiB matrix took 2-3 requests; measured on that disk
// (/sys/block/vda/stat, bench/bench_ram_real.py), runs whose reads averaged 0.8-0.9 MB per request moved 0.57-0.62
// GB/s and those at 1.1-1.4 MB 0.74-1.08 GB/s, whichever process had the more fragmented memory. A 2 MiB huge page
// is one segment.
class StagingBuffer {
public:
    explicit StagingBuffer(size_t bytes) {
        const size_t huge = (size_t) 2 << 20;
        const size_t want = (bytes + huge - 1) / huge * huge;
        len_ = want + huge;  // room to align the start to a huge page
        void * m = mmap(nullptr, len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            len_ = 0;
            return;
        }
        base_ = (uint8_t *) m;
        data_ = (uint8_t *) (((uintptr_t) base_ + huge - 1) / huge * huge);
#ifdef MADV_HUGEPAGE
        madvise(data_, want, MADV_HUGEPAGE);  // a hint: without THP the pages stay 4 KiB, and reads work alike
#endif
        std::memset(data_, 0, want);  // fault the pages in now, not during the first reads
    }
    ~StagingBuffer() {
        if (base_) munmap(base_, len_);
    }
    StagingBuffer(const StagingBuffer &) = delete;
    StagingBuffer & operator=(const StagingBuffer &) = delete;
    uint8_t * data() const { return data_; }

private:
    uint8_t * base_ = nullptr;
    uint8_t * data_ = nullptr;
    size_t len_ = 0;
};

}  // namespace

void RamTier::worker() {
    // this worker's staging buffer for direct reads (none when no file takes them)
    std::unique_ptr<StagingBuffer> staging_buf;
    bool any_direct = false;
    for (int d : direct_fds_) any_direct = any_direct || d >= 0;
    if (any_direct) staging_buf.reset(new StagingBuffer((size_t) staging_bytes_));
    uint8_t * staging = staging_buf ? staging_buf->data() : nullptr;
    // where a matrix to repack is read before it is repacked into its slot (the largest matrix's bytes)
    std::vector<uint8_t> tmp;
    if (repack_marker_) {
        int64_t most = 0;
        for (const auto & eb : expert_bytes_) most = std::max({most, eb[0], eb[1], eb[2]});
        tmp.resize((size_t) most);
    }
    for (;;) {
        Job j{};
        int conc = 1;
        {
            std::unique_lock<std::mutex> lock(mu_);
            cv_work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
            if (stop_) return;
            j = queue_.front();
            queue_.pop_front();
            conc = ++in_flight_;
        }
        const auto t0 = std::chrono::steady_clock::now();
        std::string err = read_expert(j, staging, tmp.empty() ? nullptr : tmp.data());
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        {
            std::lock_guard<std::mutex> lock(mu_);
            --in_flight_;
            // the disk's time per byte: this read's time shared by the reads in flight when it started (the
            // planner's read estimate, read_estimate_s)
            const auto & eb = expert_bytes_[(size_t) (j.key / n_expert_)];
            const double bytes = (double) (eb[0] + eb[1] + eb[2]);
            if (err.empty() && bytes > 0.0) {
                const double spb = dt / (double) std::max(1, conc) / bytes;
                read_spb_ = read_spb_ > 0.0 ? 0.9 * read_spb_ + 0.1 * spb : spb;
            }
            if (err.empty()) {
                state_[(size_t) j.key] = 2;
            } else {
                state_[(size_t) j.key] = 0;
                key_error_[(size_t) j.key] = std::move(err);
            }
            done_.push_back(j.key);
        }
        cv_done_.notify_all();
    }
}

int64_t RamTier::read_range(int32_t f, uint8_t * dst, int64_t n, int64_t off, uint8_t * staging, uint64_t & calls,
                            bool & direct, const uint8_t ** in_staging, bool into_slot) {
    const int dfd = direct_fds_[(size_t) f];
    if (into_slot) staging = dst - off % kDirectAlign;  // the slot is the staging buffer: the bytes land in place
    if (dfd >= 0 && staging != nullptr) {
        // O_DIRECT: the aligned range around the bytes into the staging buffer (DMA, no page cache), then a copy
        // unless it was the slot
        const int64_t lo = off / kDirectAlign * kDirectAlign;
        const int64_t hi = (off + n + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
        int64_t got = 0;  // bytes from lo
        bool refused = false;
        while (lo + got < off + n) {
            const ssize_t r = ::pread(dfd, staging + got, (size_t) (hi - lo - got), (off_t) (lo + got));
            ++calls;
            if (r < 0 && errno == EINTR) continue;
            if (r < 0 && errno == EINVAL && got == 0) {  // this file system takes no direct reads here: buffered
                refused = true;
                break;
            }
            if (r < 0) return -errno;
            if (r == 0) break;  // the file ends
            got += r;
            if (got % kDirectAlign != 0) break;  // a short direct read ends at the end of the file
        }
        if (!refused) {
            direct = true;
            const int64_t have = std::max<int64_t>(0, std::min<int64_t>(lo + got - off, n));
            if (in_staging) {
                *in_staging = staging + (off - lo);  // the caller takes the bytes from the staging buffer
            } else if (!into_slot) {
                std::memcpy(dst, staging + (off - lo), (size_t) have);
            }
            return have;
        }
    }
    int64_t got = 0;
    while (got < n) {
        const ssize_t r = ::pread(fds_[(size_t) f], dst + got, (size_t) (n - got), (off_t) (off + got));
        ++calls;
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -errno;
        if (r == 0) break;
        got += r;
    }
    return got;
}

void RamTier::copy_extras(int32_t slot, int expert, const ExpertMatrices & host) {
    // biases and scales load with the model (host tensors): copied into the slot as the GPU pool copies them
    const auto biases = host.slot_biases(), scales = host.slot_scales();
    for (int i = 0; i < 3; ++i) {
        if (biases[i]) {
            std::memcpy(pool_.slot_data(slot, 3 + i),
                        (const char *) biases[i]->data + (size_t) expert * biases[i]->nb[1],
                        (size_t) biases[i]->ne[0] * sizeof(float));
        }
        if (scales[i]) {
            std::memcpy(pool_.slot_data(slot, 6 + i),
                        (const char *) scales[i]->data + (size_t) expert * scales[i]->nb[0], sizeof(float));
        }
    }
}

bool RamTier::give_up(int layer, int expert) {
    const int64_t key = (int64_t) layer * n_expert_ + expert;
    if (!cache_->resident(layer, expert) || pin_count_[(size_t) key] > 0) return false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (state_[(size_t) key] != 2) return false;  // being read: its read's own pin would say so too
        state_[(size_t) key] = 0;
        prefetched_[(size_t) key] = 0;
    }
    cache_->evict(layer, expert);  // records no eviction: the slot is given back here
    pool_.evict(key);
    std::lock_guard<std::mutex> slock(stats_mu_);
    stats_.given_up += 1;
    return true;
}

std::array<uint8_t *, 3> RamTier::demote(int layer, int expert, double now_s) {
    std::array<uint8_t *, 3> none{nullptr, nullptr, nullptr};
    if (cache_->resident(layer, expert) || workers_.empty()) return none;
    for (int i = 0; i < 3; ++i) {
        if (repack_[(size_t) layer][(size_t) i]) return none;  // the GPU holds the file's layout, the slots not
    }
    if (!cache_->admit_demoted(layer, expert, now_s)) return none;
    drop_evicted();
    if (!pool_.assign(layer, expert)) {
        throw std::logic_error("RAM tier: the cache admitted MoE layer " + std::to_string(layer) + " expert " +
                               std::to_string(expert) + " back from the GPU but no RAM slot is free");
    }
    const int32_t slot = pool_.slot_of(layer, expert);
    std::array<uint8_t *, 3> out = none;
    for (int i = 0; i < 3; ++i) {
        if (expert_bytes_[(size_t) layer][(size_t) i] > 0) out[(size_t) i] = matrix_at(slot, layer, i);
    }
    return out;
}

void RamTier::demoted(int layer, int expert) {
    const int64_t key = (int64_t) layer * n_expert_ + expert;
    ExpertMatrices host;
    {
        std::lock_guard<std::mutex> lock(mu_);
        host = layers_[(size_t) layer];
    }
    copy_extras(pool_.slot_of(layer, expert), expert, host);
    {
        std::lock_guard<std::mutex> lock(mu_);
        state_[(size_t) key] = 2;
        prefetched_[(size_t) key] = 0;
    }
    std::lock_guard<std::mutex> slock(stats_mu_);
    stats_.demotions += 1;
}

std::string RamTier::read_expert(const Job & j, uint8_t * staging, uint8_t * tmp) {
    const int layer = (int) (j.key / n_expert_), expert = (int) (j.key % n_expert_);
    ExpertMatrices host;
    std::array<bool, 3> rp{false, false, false};
    int fault = 0;
    {
        std::lock_guard<std::mutex> lock(mu_);
        host = layers_[(size_t) layer];
        rp = repack_[(size_t) layer];
        if (fault_count_ > 0) {
            --fault_count_;
            fault = fault_errno_;
        }
    }
    uint64_t calls = 0, n_direct = 0, n_in_place = 0;
    for (int i = 0; i < 3; ++i) {
        const int32_t f = where_.file_of[(size_t) layer][(size_t) i];
        if (f < 0) continue;
        const int64_t n = expert_bytes_[(size_t) layer][(size_t) i];
        const int64_t off = where_.offset_of[(size_t) layer][(size_t) i] + n * expert;
        uint8_t * slot = matrix_at(j.slot, layer, i);
        const bool repack = rp[(size_t) i] && tmp != nullptr;
        // a matrix to repack is read into the worker's buffer first, or repacked from the staging buffer of a
        // direct read (one copy fewer)
        uint8_t * dst = repack ? tmp : slot;
        const uint8_t * src = dst;
        bool direct = false;
        const int64_t got =
            fault ? -fault
                  : read_range(f, dst, n, off, staging, calls, direct, repack ? &src : nullptr,
                               !repack && into_slot_[(size_t) layer][(size_t) i]);
        if (fault) ++calls;
        if (got < n) {
            const std::string why = got < 0 ? std::strerror((int) -got)
                                            : "the file ends there (truncated or replaced while the model runs)";
            std::lock_guard<std::mutex> slock(stats_mu_);
            stats_.preads += calls;
            return "reading " + std::to_string(n) + " bytes of MoE layer " + std::to_string(layer) + " expert " +
                   std::to_string(expert) + " at offset " + std::to_string(off + std::max<int64_t>(0, got)) + " of " +
                   where_.files[(size_t) f] + ": " + why;
        }
        n_direct += direct ? 1 : 0;
        n_in_place += direct && !repack && into_slot_[(size_t) layer][(size_t) i] ? 1 : 0;
        if (repack) {
            const ggml_tensor * w = host.slot_matrices()[(size_t) i];
            if (!repack_matrix(repack_marker_, w->type, w->ne[0], w->ne[1], src, slot)) {
                return "repacking MoE layer " + std::to_string(layer) + " expert " + std::to_string(expert) +
                       ": ggml-cpu has no repacked layout for it";
            }
        }
        // Not after direct reads: they bypass the page cache (a file system that serves O_DIRECT through its page
        // cache instead: HYBRIMOE_RAM_DIRECT_IO=0, buffered reads and these drops)
        if (!direct && cfg_.drop_after_read) {
            // The page cache holds a file in folios of up to 2 MiB (large folios), and DONTNEED drops only the
            // folios wholly inside its range: the range is rounded out to 2 MiB, within this tensor's bytes (the
            // kernel rounds its ends in to pages), so that the neighbouring experts' parts of a folio go too (they
            // are not meant to be in RAM through the page cache) and no weight outside the experts does.
            const int64_t t_lo = where_.offset_of[(size_t) layer][(size_t) i], t_hi = t_lo + n * n_expert_;
            const int64_t lo = std::max(t_lo, off / kDropGranule * kDropGranule);
            const int64_t hi = std::min(t_hi, (off + n + kDropGranule - 1) / kDropGranule * kDropGranule);
            posix_fadvise(fds_[(size_t) f], (off_t) lo, (off_t) (hi - lo), POSIX_FADV_DONTNEED);
        }
    }
    copy_extras(j.slot, expert, host);
    std::lock_guard<std::mutex> slock(stats_mu_);
    stats_.preads += calls;
    stats_.direct_matrices += n_direct;
    stats_.in_place_matrices += n_in_place;
    return "";
}

void RamTier::harvest() {
    std::vector<int64_t> done;
    {
        std::lock_guard<std::mutex> lock(mu_);
        done.swap(done_);
    }
    for (int64_t key : done) unpin(key);  // the read's own pin
}

void RamTier::wait_for(int64_t key) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_done_.wait(lock, [&] { return state_[(size_t) key] != 1; });
}

void RamTier::acquire(int layer, const std::vector<int32_t> & experts, const std::vector<int32_t> & loads,
                      int n_tokens, int top_k, const std::vector<float> & scores, int64_t step, double now_s) {
    LayerObservation obs;
    obs.step = step;
    obs.set_routed(layer, n_tokens, top_k, n_expert_, experts, loads);
    obs.scores = scores;
    acquire(obs, experts, now_s);
}

void RamTier::check_files() const {
    for (size_t f = 0; f < fds_.size(); ++f) {
        struct stat st {};
        const std::string changed = where_.change(f, fds_[f], st);
        if (!changed.empty()) {
            throw std::runtime_error("RAM tier: " + where_.files[f] + " changed while the model runs: " + changed +
                                     "; its experts can no longer be read as loaded (load the model again)");
        }
    }
}

void RamTier::acquire(const LayerObservation & seen, const std::vector<int32_t> & experts, double now_s,
                      size_t wait_first) {
    const int layer = seen.layer;
    // once per ubatch (its first MoE layer): a file written in place keeps its size, so its modification time is
    // checked too (an fstat per file; a short read catches a truncation between two checks)
    if (layer == 0) {
        check_files();
        if (!dropped_again_) {  // the load's read-ahead that was still in flight when the tier opened
            drop_expert_pages();
            dropped_again_ = true;
        }
    }
    harvest();
    // the policy sees the whole layer's routing (its scores rank every expert), the lookups only the CPU's experts
    cache_->observe(seen);
    uint64_t hits = 0, late = 0, misses = 0, used = 0;
    std::vector<int64_t> wait;
    rest_wait_.clear();
    for (size_t j = 0; j < experts.size(); ++j) {
        const int32_t e = experts[j];
        // the experts past wait_first are waited for by wait_rest()
        std::vector<int64_t> & waits = j < wait_first ? wait : rest_wait_;
        const int64_t key = (int64_t) layer * n_expert_ + e;
        cache_->access(layer, e, now_s);
        uint8_t st;
        {
            std::lock_guard<std::mutex> lock(mu_);
            st = state_[(size_t) key];
            if (const uint8_t tag = prefetched_[(size_t) key]) {
                prefetched_[(size_t) key] = 0;
                ++used;
                if (judged_tag(tag)) judge(tag, true);
            }
        }
        if (cache_->resident(layer, e) && st != 0) {
            ++hits;
            if (st == 1) {
                ++late;
                waits.push_back(key);
            }
            pin(key);
            pins_[(size_t) layer].push_back(e);
            continue;
        }
        ++misses;
        if (!start_read(layer, e, 0, now_s)) {
            // every slot is pinned: the reads in flight end and the prefetches for other layers give theirs up
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_done_.wait(lock, [&] { return queue_.empty() && in_flight_ == 0; });
            }
            harvest();
            for (int l = 0; l < n_layers_; ++l) {
                if (l == layer) continue;
                for (int32_t p : prefetch_pins_[(size_t) l]) {
                    unpin((int64_t) l * n_expert_ + p);
                    std::lock_guard<std::mutex> lock(mu_);
                    prefetched_[(size_t) l * n_expert_ + p] = 0;  // given up before its layer: not judged
                }
                prefetch_pins_[(size_t) l].clear();
            }
            if (!start_read(layer, e, 0, now_s)) {
                throw std::runtime_error("the RAM expert cache (" + std::to_string(pool_.n_slots()) +
                                         " slots) cannot hold the " + std::to_string(experts.size()) +
                                         " experts MoE layer " + std::to_string(layer) +
                                         " uses at once; give moe_ram_cache at least that many experts' bytes");
            }
        }
        pin(key);
        pins_[(size_t) layer].push_back(e);
        waits.push_back(key);
    }
    {
        std::lock_guard<std::mutex> slock(stats_mu_);
        stats_.accesses += experts.size();
        stats_.hits += hits;
        stats_.late += late;
        stats_.misses += misses;
        stats_.prefetch_used += used;
    }
    wait_keys(wait);
}

void RamTier::wait_rest() {
    std::vector<int64_t> keys;
    keys.swap(rest_wait_);
    wait_keys(keys);
}

void RamTier::wait_keys(const std::vector<int64_t> & keys) {
    const auto t0 = std::chrono::steady_clock::now();
    std::string err;
    for (int64_t key : keys) {
        wait_for(key);
        std::lock_guard<std::mutex> lock(mu_);
        if (err.empty() && !key_error_[(size_t) key].empty()) err = key_error_[(size_t) key];
        key_error_[(size_t) key].clear();
    }
    harvest();
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
        std::lock_guard<std::mutex> slock(stats_mu_);
        stats_.wait_s += waited;
    }
    if (!err.empty()) throw std::runtime_error(err);
}

void RamTier::note_used(int layer, int expert) {
    std::lock_guard<std::mutex> lock(mu_);
    uint8_t & tag = prefetched_[(size_t) layer * n_expert_ + expert];
    if (!tag) return;
    if (judged_tag(tag)) judge(tag, true);
    tag = 0;
    std::lock_guard<std::mutex> slock(stats_mu_);
    stats_.prefetch_used += 1;
}

void RamTier::release(int layer) {
    for (int32_t e : pins_[(size_t) layer]) unpin((int64_t) layer * n_expert_ + e);
    pins_[(size_t) layer].clear();
    {
        // the layer ran: what was read ahead for it and not used there is judged a miss
        std::lock_guard<std::mutex> lock(mu_);
        for (int32_t e : prefetch_pins_[(size_t) layer]) {
            uint8_t & tag = prefetched_[(size_t) layer * n_expert_ + e];
            if (judged_tag(tag)) judge(tag, false);
            tag = 0;
        }
    }
    for (int32_t e : prefetch_pins_[(size_t) layer]) unpin((int64_t) layer * n_expert_ + e);
    prefetch_pins_[(size_t) layer].clear();
}

double RamTier::read_estimate_s(int layer) const {
    const auto & eb = expert_bytes_[(size_t) layer];
    std::lock_guard<std::mutex> lock(mu_);
    return read_spb_ * (double) (eb[0] + eb[1] + eb[2]);
}

bool RamTier::ready(int layer, int expert) const {
    if (!cache_->resident(layer, expert) || pool_.slot_of(layer, expert) < 0) return false;
    std::lock_guard<std::mutex> lock(mu_);
    return state_[(size_t) layer * n_expert_ + expert] == 2;
}

std::array<const uint8_t *, 3> RamTier::matrices(int layer, int expert) const {
    const int32_t s = pool_.slot_of(layer, expert);
    if (s < 0) throw std::logic_error("RAM tier: MoE layer " + std::to_string(layer) + " expert " +
                                      std::to_string(expert) + " has no RAM slot");
    std::array<const uint8_t *, 3> out{};
    for (int i = 0; i < 3; ++i) {
        out[(size_t) i] = expert_bytes_[(size_t) layer][(size_t) i] > 0 ? matrix_at(s, layer, i) : nullptr;
    }
    return out;
}

void RamTier::judge(uint8_t tag, bool used) {
    const size_t d = (size_t) tag - 1;
    ahead_judged_[d] += 1;
    ahead_used_[d] += used ? 1 : 0;
    if (ahead_judged_[d] >= kWindowOutcomes) {  // halved: the share follows the recent reads
        ahead_judged_[d] /= 2;
        ahead_used_[d] /= 2;
    }
}

int RamTier::prefetch(const std::vector<Prediction> & predictions, int64_t keep_free, double now_s, int n_tokens,
                      int top_k, const std::vector<const SlotPool *> * above) {
    harvest();
    struct Cand {
        double confidence;
        int distance;
        int32_t load;
        int layer;
        int32_t expert;
        uint8_t tag;
    };
    const double prior = expert_use_prior(top_k, n_expert_, n_tokens);
    const bool small = prior < cfg_.min_prefetch_confidence;
    const bool several = !small && prior < cfg_.certain_use;  // several sequences' decode: shares per cell
    const int n_sample = std::min(n_tokens, RouterPredictor::kSampleTokens);
    const double unpredicted = small ? 0.0
                               : several ? expert_use_prior(top_k, n_expert_, (int64_t) n_tokens - n_sample)
                                         : prior;
    std::array<uint64_t, kCells> judged{}, used{};
    {
        std::lock_guard<std::mutex> lock(mu_);
        judged = ahead_judged_;
        used = ahead_used_;
    }
    // a share cell's share used, blended with the assumed confidence counted as kPriorOutcomes outcomes
    const auto share = [&](size_t cell, double assumed) {
        return ((double) used[cell] + (double) kPriorOutcomes * assumed) / (double) (judged[cell] + kPriorOutcomes);
    };
    std::vector<Cand> cands;
    std::vector<uint8_t> seen((size_t) n_expert_);
    for (const Prediction & p : predictions) {
        if (p.layer < 0 || p.layer >= n_layers_) continue;
        const int d = std::max(1, p.distance);
        const size_t di = (size_t) std::min(d, 3) - 1;  // distances beyond 3 are judged with distance 3
        double conf = p.confidence;
        std::fill(seen.begin(), seen.end(), 0);
        if (several) {
            const double assumed = std::max(std::min(1.0, std::max(0.0, conf)), prior);
            for (size_t i = 0; i < p.experts.size(); ++i) {
                const int32_t load = i < p.loads.size() ? p.loads[i] : 1;
                // the sampled tokens that predicted it (the loads are scaled from them to the ubatch)
                const int64_t sampled = (int64_t) load * n_sample / std::max(n_tokens, 1);
                const size_t bucket = (size_t) std::min<int64_t>(std::max<int64_t>(sampled, 1), 3) - 1;
                const size_t cell = (size_t) kOneCells + di * 3 + bucket;
                seen[(size_t) p.experts[i]] = 1;
                double c = share(cell, assumed);
                // a probe now and then keeps a cell measured low measured
                if (c < cfg_.min_prefetch_confidence && ++probe_calls_[cell] % kProbeEvery == 0) {
                    c = cfg_.min_prefetch_confidence;
                }
                if (c >= cfg_.min_prefetch_confidence) {
                    cands.push_back({c, d, load, p.layer, p.experts[i], (uint8_t) (cell + 1)});
                }
            }
        } else {
            size_t first = 0, last = p.experts.size();  // the predicted experts read ahead: [first, last)
            if (small) {
                conf = share(di, std::min(1.0, std::max(0.0, conf)));
                // a probe now and then, so that a share measured low can be measured again (the routing may
                // change): one expert of the prediction (the most tokens predicted), so that a look-ahead that
                // misses costs one read per probe, not top_k
                if (conf < cfg_.min_prefetch_confidence && ++probe_calls_[di] % kProbeEvery == 0 && last > 0) {
                    conf = cfg_.min_prefetch_confidence;
                    for (size_t i = 1; i < p.loads.size() && i < last; ++i) {
                        if (p.loads[i] > p.loads[first]) first = i;
                    }
                    last = first + 1;
                }
            }
            conf = std::max(conf, prior);
            const uint8_t tag = small ? (uint8_t) (di + 1) : kUncounted;
            if (conf >= cfg_.min_prefetch_confidence) {
                for (size_t i = first; i < last; ++i) {
                    cands.push_back({conf, d, i < p.loads.size() ? p.loads[i] : 1, p.layer, p.experts[i], tag});
                    seen[(size_t) p.experts[i]] = 1;
                }
            }
        }
        // the experts no sampled token predicted, where their use is likely: a prefill's at the ubatch's prior, a
        // ubatch of more than kSampleTokens tokens at the prior of the tokens the look-ahead did not score
        if (unpredicted >= cfg_.min_prefetch_confidence) {
            for (int32_t e = 0; e < n_expert_; ++e) {
                if (!seen[(size_t) e]) cands.push_back({unpredicted, d, 0, p.layer, e, kUncounted});
            }
        }
    }
    // the reads that save the most first: a likelier use, a nearer layer, then more tokens waiting for it (every
    // expert of a layer costs the same read, so per byte the order is the same)
    std::stable_sort(cands.begin(), cands.end(), [](const Cand & a, const Cand & b) {
        if (a.confidence != b.confidence) return a.confidence > b.confidence;
        if (a.distance != b.distance) return a.distance < b.distance;
        return a.load > b.load;
    });
    int queued = 0;
    for (const Cand & c : cands) {
        if (pool_.n_slots() - n_pinned_ <= keep_free) break;
        if (above && (*above)[(size_t) c.layer]->slot_of(c.layer, c.expert) >= 0) continue;  // on the GPU (exclusive)
        const int64_t key = (int64_t) c.layer * n_expert_ + c.expert;
        if (pin_count_[(size_t) key] > 0) continue;  // pinned already: being read, used now, or kept for its layer
        uint8_t st;
        {
            std::lock_guard<std::mutex> lock(mu_);
            st = state_[(size_t) key];
        }
        if (!(cache_->resident(c.layer, c.expert) && st == 2)) {
            // a read its layer needs anyway (a prefill's) is admitted as the demand read it would otherwise become
            const bool certain = c.confidence >= (c.tag > kOneCells && judged_tag(c.tag) ? cfg_.confident_use
                                                                                          : cfg_.certain_use);
            if (!start_read(c.layer, c.expert, c.tag, now_s, certain)) continue;
            ++queued;
        }
        pin(key);
        prefetch_pins_[(size_t) c.layer].push_back(c.expert);
    }
    return queued;
}

RamTierStats RamTier::stats() const {
    std::lock_guard<std::mutex> slock(stats_mu_);
    return stats_;
}

std::array<std::array<uint64_t, 2>, RamTier::kCells> RamTier::ahead_counts() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::array<std::array<uint64_t, 2>, kCells> out{};
    for (size_t i = 0; i < (size_t) kCells; ++i) out[i] = {ahead_judged_[i], ahead_used_[i]};
    return out;
}

void RamTier::reset_stats() {
    std::lock_guard<std::mutex> slock(stats_mu_);
    stats_ = RamTierStats{};
}

int RamTier::reads_in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return (int) queue_.size() + in_flight_;
}

void RamTier::inject_read_error(int err, int count) {
    std::lock_guard<std::mutex> lock(mu_);
    fault_errno_ = err;
    fault_count_ = err ? count : 0;
}

void RamTier::set_layer(int layer, const ExpertMatrices & m) {
    std::array<bool, 3> rp{false, false, false};
    if (repack_marker_) {
        const auto mats = m.slot_matrices();
        for (size_t i = 0; i < 3; ++i) {
            rp[i] = mats[i] && cpu_repacks(mats[i]->type, mats[i]->ne[0], mats[i]->ne[1]);
        }
    }
    std::lock_guard<std::mutex> lock(mu_);
    layers_[(size_t) layer] = m;
    repack_[(size_t) layer] = rp;
    for (size_t i = 0; i < 3; ++i) {
        // a repacked matrix is written by the repack, not read in place: it starts at its slot's aligned start,
        // as ggml's repacked buffers start theirs. Written at the first graph build, before any read; a later
        // build (another ubatch size, reads in flight) finds the same values and writes nothing.
        if (!rp[i] || (phase_[(size_t) layer][i] == 0 && !into_slot_[(size_t) layer][i])) continue;
        phase_[(size_t) layer][i] = 0;
        into_slot_[(size_t) layer][i] = false;
    }
}

bool RamTier::repacked(int layer, int region) const {
    std::lock_guard<std::mutex> lock(mu_);
    return repack_[(size_t) layer][(size_t) region];
}

}  // namespace hybrimoe
