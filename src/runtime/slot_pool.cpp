#include "runtime/slot_pool.h"

#include "ggml-alloc.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>

namespace hybrimoe {

namespace {

constexpr int64_t kAlign = 256;
constexpr int64_t kHugePage = 2 << 20;  // x86-64's transparent huge page

int64_t round_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

}  // namespace

std::array<int64_t, 3> SlotPool::region_strides(const std::vector<std::array<int64_t, 3>> & eb,
                                                const std::vector<std::array<int32_t, 3>> & et,
                                                int64_t direct_align) {
    if (eb.size() != et.size()) throw std::invalid_argument("engine: one (gate, up, down) type triple per MoE layer");
    std::array<int64_t, 3> mx{0, 0, 0}, unit{16, 16, 16};
    for (size_t l = 0; l < eb.size(); ++l) {
        for (size_t i = 0; i < 3; ++i) {
            if (et[l][i] < 0 || et[l][i] >= GGML_TYPE_COUNT) {
                throw std::invalid_argument("engine: unknown ggml type " + std::to_string(et[l][i]));
            }
            if (ggml_type_size((ggml_type) et[l][i]) == 0 || ggml_blck_size((ggml_type) et[l][i]) == 0) {
                // a type number upstream removed (e.g. Q4_0_4_4): no block layout to place in a slot
                throw std::invalid_argument("engine: ggml type " + std::to_string(et[l][i]) + " (" +
                                            ggml_type_name((ggml_type) et[l][i]) + ") has no block layout");
            }
            mx[i] = std::max(mx[i], eb[l][i]);
            unit[i] = std::lcm(unit[i], (int64_t) ggml_type_size((ggml_type) et[l][i]));
        }
    }
    if (direct_align < 0 || (direct_align > 0 && direct_align % kAlign != 0)) {
        throw std::invalid_argument("engine: a direct-read alignment must be a multiple of " + std::to_string(kAlign));
    }
    // a kind whose matrices are a whole number of direct_align blocks in some layer can be read in place there
    std::array<bool, 3> in_place{false, false, false};
    for (size_t l = 0; direct_align > 0 && l < eb.size(); ++l) {
        for (size_t i = 0; i < 3; ++i) in_place[i] = in_place[i] || (eb[l][i] > 0 && eb[l][i] % direct_align == 0);
    }
    std::array<int64_t, 3> st{};
    for (size_t i = 0; i < 3; ++i) {
        st[i] = in_place[i] ? round_up(mx[i] + direct_align, direct_align) : round_up(mx[i], unit[i]);
    }
    return st;
}

namespace {

// Per-slot stride of each of the (gate, up, down) F32 regions: the largest per-layer size of that kind, after `check`
// (which throws on a size the region cannot hold) and `round` (the region's alignment). `what` names the triples.
template <typename Check, typename Round>
std::array<int64_t, 3> f32_region_strides(const std::vector<std::array<int64_t, 3>> & sizes, size_t expert_layers,
                                          const char * what, Check check, Round round) {
    std::array<int64_t, 3> st{0, 0, 0};
    if (sizes.empty()) return st;
    if (sizes.size() != expert_layers) {
        throw std::invalid_argument(std::string("engine: one (gate, up, down) ") + what + " size triple per MoE layer (" +
                                    std::to_string(sizes.size()) + " for " + std::to_string(expert_layers) + " layers)");
    }
    for (const auto & l : sizes) {
        for (size_t i = 0; i < 3; ++i) {
            check(l[i]);
            st[i] = std::max(st[i], round(l[i]));
        }
    }
    return st;
}

}  // namespace

std::array<int64_t, 3> SlotPool::bias_strides(const std::vector<std::array<int64_t, 3>> & bb, size_t expert_layers) {
    // one F32 row per slot (ggml_add_id), each region 16-byte aligned
    return f32_region_strides(
        bb, expert_layers, "bias",
        [](int64_t n) {
            if (n < 0 || n % (int64_t) sizeof(float) != 0) {
                throw std::invalid_argument("engine: an expert bias row of " + std::to_string(n) +
                                            " bytes is not a whole number of F32 values");
            }
        },
        [](int64_t n) { return (n + 15) / 16 * 16; });
}

std::array<int64_t, 3> SlotPool::scale_strides(const std::vector<std::array<int64_t, 3>> & sb,
                                               size_t expert_layers) {
    // one F32 per slot (build_lora_mm_id's per-expert scale), or none
    return f32_region_strides(
        sb, expert_layers, "scale",
        [](int64_t n) {
            if (n != 0 && n != (int64_t) sizeof(float)) {
                throw std::invalid_argument("engine: a per-expert scale of " + std::to_string(n) +
                                            " bytes (one F32 per expert, or 0 for none)");
            }
        },
        [](int64_t n) { return n; });
}

int64_t SlotPool::slot_bytes_for(const std::vector<std::array<int64_t, 3>> & eb,
                                 const std::vector<std::array<int32_t, 3>> & et,
                                 const std::vector<std::array<int64_t, 3>> & bb,
                                 const std::vector<std::array<int64_t, 3>> & sb, int64_t direct_align) {
    const auto st = region_strides(eb, et, direct_align);
    const auto bs = bias_strides(bb, eb.size());
    const auto ss = scale_strides(sb, eb.size());
    int64_t n = 0;
    for (size_t i = 0; i < 3; ++i) n += st[i] + bs[i] + ss[i];
    return n;
}

SlotPool::SlotPool(int n_layers, int n_expert, const std::vector<std::array<int64_t, 3>> & expert_bytes,
                   const std::vector<std::array<int32_t, 3>> & expert_types,
                   const std::vector<std::array<int64_t, 3>> & bias_bytes,
                   const std::vector<std::array<int64_t, 3>> & scale_bytes, int64_t direct_align)
    : n_layers_(n_layers), n_expert_(n_expert), direct_align_(direct_align) {
    const auto st = region_strides(expert_bytes, expert_types, direct_align);
    // no kind read in place (none stored in whole blocks): nothing to align beyond the usual
    if (st == region_strides(expert_bytes, expert_types)) direct_align_ = 0;
    const auto bs = bias_strides(bias_bytes, expert_bytes.size());
    const auto ss = scale_strides(scale_bytes, expert_bytes.size());
    for (size_t i = 0; i < 3; ++i) {
        strides_[i] = st[i];
        strides_[3 + i] = bs[i];
        strides_[6 + i] = ss[i];
    }
    slot_bytes_ = 0;
    for (int64_t v : strides_) slot_bytes_ += v;
    const size_t keys = (size_t) n_layers_ * (size_t) n_expert_;
    key_slot_.assign(keys, -1);
    key_loaded_.assign(keys, 0);
    key_copy_seq_.assign(keys, 0);
}

SlotPool::~SlotPool() { release(); }

int64_t SlotPool::region_base(int which, int64_t n) const {
    int64_t off = 0;
    const int64_t a = std::max(kAlign, direct_align_);
    for (int i = 0; i < which; ++i) off += round_up((n + 1) * strides_[(size_t) i], a);
    return off;
}

int64_t SlotPool::slots_per_buffer_for(int64_t n_slots, int64_t max_buffer_bytes) const {
    if (n_slots < 1) return 1;
    if (max_buffer_bytes <= 0 || buffer_bytes_for(n_slots) <= max_buffer_bytes) return n_slots;
    // padding adds at most kRegions * kAlign bytes: start from the bound without it and step down to what fits
    int64_t n = std::min(n_slots, max_buffer_bytes / std::max<int64_t>(slot_bytes_, 1) - 1);
    while (n >= 1 && buffer_bytes_for(n) > max_buffer_bytes) --n;
    if (n < 1) {
        throw std::runtime_error("engine: one expert slot and its null slot need " +
                                 std::to_string(buffer_bytes_for(1)) + " bytes, more than the " +
                                 std::to_string(max_buffer_bytes) + " bytes one device buffer may hold");
    }
    return n;
}

void SlotPool::open(ggml_backend_dev_t device, int64_t n_slots, int64_t max_buffer_bytes) {
    if (!device) throw std::invalid_argument("engine: a device is required for a non-empty expert cache");
    if (n_slots < 1) throw std::invalid_argument("engine: a slot pool needs at least one slot");
    if (max_buffer_bytes < 0) throw std::invalid_argument("engine: negative max_buffer_bytes");
    release();
    device_ = device;
    device_name_ = ggml_backend_dev_name(device);
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(device, &props);
    compute_ = ggml_backend_dev_init(device, nullptr);
    copy_ = ggml_backend_dev_init(device, nullptr);
    if (!compute_ || !copy_) {
        release();
        throw std::runtime_error("engine: cannot initialise device " + device_name_);
    }
    if (props.caps.events) {
        for (int i = 0; i < kEvents; ++i) {
            ggml_backend_event_t ev = ggml_backend_event_new(device);
            if (!ev) {
                release();
                throw std::runtime_error("engine: device " + device_name_ + " reports events but cannot create one");
            }
            events_.push_back(ev);
        }
    }
    host_buft_ = props.caps.host_buffer ? ggml_backend_dev_host_buffer_type(device) : nullptr;

    // a device caps one buffer (ggml_backend_buft_get_max_size; SIZE_MAX where it has no cap, e.g. CUDA): split
    // the slots over as few buffers as that allows
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(compute_);
    const size_t dev_max = ggml_backend_buft_get_max_size(buft);
    int64_t cap = dev_max >= (size_t) INT64_MAX ? INT64_MAX : (int64_t) dev_max;
    if (max_buffer_bytes > 0) cap = std::min(cap, max_buffer_bytes);
    try {
        per_buf_ = slots_per_buffer_for(n_slots, cap);
    } catch (const std::runtime_error & e) {
        release();
        throw std::runtime_error(std::string(e.what()) + " (" + device_name_ + ")");
    }
    n_slots_ = n_slots;
    const int64_t n_bufs = (n_slots_ + per_buf_ - 1) / per_buf_;
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (n_bufs + 1), nullptr, true};
    ctx_ = ggml_init(ip);
    int64_t total = 0;
    for (int64_t b = 0; b < n_bufs; ++b) {
        const int64_t bytes = buffer_bytes_for(std::min(per_buf_, n_slots_ - b * per_buf_));
        ggml_tensor * t = ggml_new_tensor_1d(ctx_, GGML_TYPE_I8, bytes);
        ggml_format_name(t, "hybrimoe_slots_%d", (int) b);
        bufs_.push_back(t);
        total += bytes;
    }
    // one call: ggml-alloc packs the tensors into as many device buffers as the buffer type's max size needs
    buf_ = ggml_backend_alloc_ctx_tensors_from_buft(ctx_, buft);
    if (!buf_) {
        const std::string name = device_name_;
        release();
        throw std::runtime_error("engine: cannot allocate " + std::to_string(total) + " bytes of expert slots (" +
                                 std::to_string(n_bufs) + " buffers) on " + name);
    }
    // each buffer's null slot must hold zeros: padded pairs point there
    for (int b = 0; b < (int) bufs_.size(); ++b) {
        const int64_t n = buffer_slots(b);
        for (int i = 0; i < kRegions; ++i) {
            if (strides_[(size_t) i] == 0) continue;
            std::vector<uint8_t> zeros((size_t) strides_[(size_t) i], 0);
            ggml_backend_tensor_set(bufs_[(size_t) b], zeros.data(),
                                    (size_t) (region_base(i, n) + n * strides_[(size_t) i]), zeros.size());
        }
    }
    slot_key_.assign((size_t) n_slots_, -1);
    free_slots_.clear();
    for (int64_t s = n_slots_ - 1; s >= 0; --s) free_slots_.push_back((int32_t) s);
}

namespace {

// bytes one host slot buffer may hold: the buffer type's cap (SIZE_MAX or 0: none) and max_buffer_bytes (> 0), the
// lower; 0 for no cap
int64_t host_cap(ggml_backend_buffer_type_t buft, int64_t max_buffer_bytes) {
    const size_t buft_max = buft ? ggml_backend_buft_get_max_size(buft) : 0;
    int64_t cap = buft_max == 0 || buft_max >= (size_t) INT64_MAX ? 0 : (int64_t) buft_max;
    if (max_buffer_bytes > 0) cap = cap > 0 ? std::min(cap, max_buffer_bytes) : max_buffer_bytes;
    return cap;
}

}  // namespace

int64_t SlotPool::host_buffers_for(ggml_backend_buffer_type_t buft, int64_t n_slots, int64_t max_buffer_bytes) const {
    const int64_t per = slots_per_buffer_for(n_slots, host_cap(buft, max_buffer_bytes));
    return (n_slots + per - 1) / per;
}

void SlotPool::open_host(ggml_backend_buffer_type_t buft, int64_t n_slots, int64_t max_buffer_bytes) {
    if (!buft || !ggml_backend_buft_is_host(buft)) {
        throw std::invalid_argument("engine: the RAM expert slots need a host buffer type");
    }
    if (n_slots < 1) throw std::invalid_argument("engine: a slot pool needs at least one slot");
    release();
    per_buf_ = slots_per_buffer_for(n_slots, host_cap(buft, max_buffer_bytes));
    n_slots_ = n_slots;
    const int64_t n_bufs = (n_slots_ + per_buf_ - 1) / per_buf_;
    ggml_init_params ip = {ggml_tensor_overhead() * (size_t) (n_bufs + 1), nullptr, true};
    ctx_ = ggml_init(ip);
    int64_t total = 0;
    for (int64_t b = 0; b < n_bufs; ++b) {
        const int64_t bytes = buffer_bytes_for(std::min(per_buf_, n_slots_ - b * per_buf_));
        ggml_tensor * t = ggml_new_tensor_1d(ctx_, GGML_TYPE_I8, bytes);
        ggml_format_name(t, "hybrimoe_ram_slots_%d", (int) b);
        bufs_.push_back(t);
        total += bytes;
    }
    if (direct_align_ > 0 && buft == ggml_backend_cpu_buffer_type()) {
        // Own memory, so that the slots start aligned (ggml's CPU allocations are aligned to 64 bytes only) and lie
        // on 2 MiB transparent huge pages where the kernel has them: an O_DIRECT read into a slot is one
        // scatter-gather segment per physically contiguous run, and a matrix over scattered 4 KiB pages takes
        // several disk requests (a virtio disk takes at most 254 segments per request).
        own_bytes_ = (size_t) (total + kHugePage);
        void * p = ::mmap(nullptr, own_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            own_bytes_ = 0;
            release();
            throw std::runtime_error("engine: cannot map " + std::to_string(total) + " bytes of RAM expert slots");
        }
        own_mem_ = p;
        auto * base = (uint8_t *) round_up((int64_t) (uintptr_t) p, kHugePage);
        madvise(base, (size_t) total, MADV_HUGEPAGE);  // advice only: without THP the slots stay on 4 KiB pages
        // Fault the slots in now, at load: else the first read into each page pays its fault (zeroing, and for a
        // huge page maybe compaction) in the I/O thread, on the cores the first prefill computes on.
#ifdef MADV_POPULATE_WRITE
        const bool populated = madvise(base, (size_t) total, MADV_POPULATE_WRITE) == 0;
#else
        const bool populated = false;
#endif
        if (!populated) {
            for (int64_t o = 0; o < total; o += 4096) ((volatile uint8_t *) base)[o] = 0;  // Linux before 5.14
        }
        buf_ = ggml_backend_cpu_buffer_from_ptr(base, (size_t) total);
        int64_t off = 0;
        for (ggml_tensor * t : bufs_) {
            if (buf_ == nullptr || ggml_backend_tensor_alloc(buf_, t, base + off) != GGML_STATUS_SUCCESS) {
                release();
                throw std::runtime_error("engine: cannot place the RAM expert slots in their own memory");
            }
            off += (int64_t) ggml_nbytes(t);
        }
    } else {
        buf_ = ggml_backend_alloc_ctx_tensors_from_buft(ctx_, buft);
    }
    if (!buf_) {
        release();
        throw std::runtime_error("engine: cannot allocate " + std::to_string(total) + " bytes of RAM expert slots (" +
                                 std::string(ggml_backend_buft_name(buft)) + ")");
    }
    host_ = true;
    direct_ok_ = direct_align_ > 0;
    for (const ggml_tensor * t : bufs_) {
        direct_ok_ = direct_ok_ && (uintptr_t) t->data % (uintptr_t) direct_align_ == 0;
    }
    // every null slot holds zeros (and no slot holds stale bytes of another process: the memory is fresh)
    for (int b = 0; b < (int) bufs_.size(); ++b) {
        const int64_t n = buffer_slots(b);
        for (int i = 0; i < kRegions; ++i) {
            if (strides_[(size_t) i] == 0) continue;
            std::memset((char *) bufs_[(size_t) b]->data + region_base(i, n) + n * strides_[(size_t) i], 0,
                        (size_t) strides_[(size_t) i]);
        }
    }
    slot_key_.assign((size_t) n_slots_, -1);
    free_slots_.clear();
    for (int64_t s = n_slots_ - 1; s >= 0; --s) free_slots_.push_back((int32_t) s);
}

uint8_t * SlotPool::slot_data(int32_t s, int which) const {
    if (!host_ || s < 0 || s >= n_slots_ || which < 0 || which >= kRegions) {
        throw std::logic_error("engine: slot_data of slot " + std::to_string(s) + " region " + std::to_string(which) +
                               " (not a host pool's)");
    }
    const int b = buffer_of(s);
    return (uint8_t *) bufs_[(size_t) b]->data + region_base(which, buffer_slots(b)) +
           (int64_t) local_slot(s) * strides_[(size_t) which];
}

void SlotPool::release() {
    if (compute_) ggml_backend_synchronize(compute_);
    if (copy_) ggml_backend_synchronize(copy_);
    for (auto * ev : events_) ggml_backend_event_free(ev);
    events_.clear();
    if (buf_) ggml_backend_buffer_free(buf_);
    if (own_mem_) ::munmap(own_mem_, own_bytes_);
    own_mem_ = nullptr;
    own_bytes_ = 0;
    direct_ok_ = false;
    if (ctx_) ggml_free(ctx_);
    if (copy_) ggml_backend_free(copy_);
    if (compute_) ggml_backend_free(compute_);
    buf_ = nullptr;
    ctx_ = nullptr;
    bufs_.clear();
    per_buf_ = 1;
    copy_ = nullptr;
    compute_ = nullptr;
    host_buft_ = nullptr;
    host_ = false;
    n_slots_ = 0;
    slot_key_.clear();
    free_slots_.clear();
    std::fill(key_slot_.begin(), key_slot_.end(), -1);
    std::fill(key_loaded_.begin(), key_loaded_.end(), 0);
}

bool SlotPool::assign(int layer, int expert) {
    const size_t key = (size_t) layer * n_expert_ + expert;
    if (key_slot_[key] >= 0) return true;
    if (free_slots_.empty()) return false;
    const int32_t s = free_slots_.back();
    free_slots_.pop_back();
    slot_key_[(size_t) s] = (int32_t) key;
    key_slot_[key] = s;
    key_loaded_[key] = 0;
    return true;
}

void SlotPool::evict(int64_t key) {
    const int32_t s = key_slot_[(size_t) key];
    if (s < 0) return;
    key_slot_[(size_t) key] = -1;
    key_loaded_[(size_t) key] = 0;
    slot_key_[(size_t) s] = -1;
    free_slots_.push_back(s);
}

int32_t SlotPool::slot_of(int layer, int expert) const {
    if (layer < 0 || layer >= n_layers_ || expert < 0 || expert >= n_expert_) return -1;
    return key_slot_[(size_t) layer * n_expert_ + expert];
}

int SlotPool::slots_in_use() const {
    int n = 0;
    for (int32_t k : slot_key_) n += k >= 0 ? 1 : 0;
    return n;
}

double SlotPool::copy(int layer, int expert, const ExpertMatrices & m, int bias_expert,
                      const std::array<const uint8_t *, 3> * matrices) {
    const size_t key = (size_t) layer * n_expert_ + expert;
    const int32_t s = key_slot_[key];
    if (s < 0 || key_loaded_[key] || bufs_.empty()) return 0.0;
    const auto mats = m.slot_matrices(), biases = m.slot_biases(), scales = m.slot_scales();
    const ggml_tensor * parts[kRegions] = {mats[0],   mats[1],   mats[2],   biases[0], biases[1],
                                           biases[2], scales[0], scales[1], scales[2]};
    // bytes of one expert's part: a matrix is nb[2] bytes (experts nb[2] apart), a bias row ne[0] floats (nb[1]
    // apart), a scale one float (nb[0] apart)
    size_t n[kRegions], step[kRegions];
    for (int i = 0; i < kRegions; ++i) {
        if (!parts[i]) continue;
        const int dim = i < 3 ? 2 : i < 6 ? 1 : 0;
        n[i] = i < 3 ? parts[i]->nb[2] : i < 6 ? (size_t) parts[i]->ne[0] * sizeof(float) : sizeof(float);
        step[i] = parts[i]->nb[dim];
        if ((int64_t) n[i] > strides_[(size_t) i]) {
            throw std::invalid_argument("engine: an expert's part " + std::to_string(i) + " of " +
                                        std::to_string(n[i]) + " bytes does not fit the slot pool's " +
                                        std::to_string(strides_[(size_t) i]) + "-byte region");
        }
    }
    const int b = buffer_of(s);
    ggml_tensor * dst = bufs_[(size_t) b];
    const int64_t n_b = buffer_slots(b), ls = local_slot(s);
    double bytes = 0;
    for (int i = 0; i < kRegions; ++i) {
        if (!parts[i]) continue;
        const int row = i >= 3 && bias_expert >= 0 ? bias_expert : expert;
        const char * src = i < 3 && matrices ? (const char *) (*matrices)[(size_t) i]
                                             : (const char *) parts[i]->data + (size_t) row * step[i];
        const size_t off = (size_t) (region_base(i, n_b) + ls * strides_[(size_t) i]);
        if (!events_.empty()) {
            ggml_backend_tensor_set_async(copy_, dst, src, off, n[i]);
        } else {
            ggml_backend_tensor_set(dst, src, off, n[i]);
        }
        bytes += (double) n[i];
    }
    key_loaded_[key] = 1;
    if (!events_.empty()) {
        ++copy_seq_;
        ggml_backend_event_record(events_[(size_t) (copy_seq_ % kEvents)], copy_);
        key_copy_seq_[key] = copy_seq_;
    }
    return bytes;
}

double SlotPool::copy_out(int layer, int expert, const std::array<int64_t, 3> & bytes,
                          const std::array<uint8_t *, 3> & dst) {
    const size_t key = (size_t) layer * n_expert_ + expert;
    const int32_t s = key_slot_[key];
    if (s < 0 || !key_loaded_[key] || bufs_.empty()) return 0.0;
    sync_copies();  // the slot's own copy may still be in flight
    const int b = buffer_of(s);
    const int64_t n_b = buffer_slots(b), ls = local_slot(s);
    double got = 0.0;
    for (int i = 0; i < 3; ++i) {
        if (bytes[(size_t) i] <= 0 || dst[(size_t) i] == nullptr) continue;
        const size_t off = (size_t) (region_base(i, n_b) + ls * strides_[(size_t) i]);
        ggml_backend_tensor_get(bufs_[(size_t) b], dst[(size_t) i], off, (size_t) bytes[(size_t) i]);
        got += (double) bytes[(size_t) i];
    }
    return got;
}

uint64_t SlotPool::sync_copies() {
    if (copy_) ggml_backend_synchronize(copy_);
    return copy_seq_;
}

void SlotPool::wait_for_copy(uint64_t seq) {
    if (seq == 0 || events_.empty()) return;
    waited_seq_ = std::max(waited_seq_, seq);
    // a ring slot holds its copy or a later one of the same in-order queue: waiting on it covers seq (the oldest
    // record still in the ring that is not older than seq: waits no longer than needed)
    const uint64_t oldest = copy_seq_ >= (uint64_t) kEvents ? copy_seq_ - kEvents + 1 : 1;
    ggml_backend_event_wait(compute_, events_[(size_t) (std::max(seq, oldest) % kEvents)]);
}

ggml_tensor * SlotPool::region_view(ggml_context * ctx, const ggml_tensor * like, int which, int b,
                                   int64_t offset) const {
    if (which < 0 || which > 2 || offset < 0 || (int64_t) like->nb[2] + offset > strides_[(size_t) which]) {
        throw std::logic_error("engine: the slot pool's matrix region " + std::to_string(which) + " cannot hold " +
                               std::to_string(like->nb[2]) + "-byte experts");
    }
    const int64_t n = buffer_slots(b), S = n + 1;
    const ggml_tensor * t = bufs_[(size_t) b];
    ggml_tensor * v = ggml_new_tensor_3d(ctx, like->type, like->ne[0], like->ne[1], S);
    v->nb[2] = (size_t) strides_[(size_t) which];
    v->nb[3] = v->nb[2] * (size_t) S;
    v->data = (char *) t->data + region_base(which, n) + offset;
    v->buffer = t->buffer;  // the device buffer this slot buffer was packed into
    return v;
}

ggml_tensor * SlotPool::bias_view(ggml_context * ctx, const ggml_tensor * like, int which, int b) const {
    const int r = 3 + which;
    if (which < 0 || which > 2 || strides_[(size_t) r] == 0 ||
        (int64_t) (like->ne[0] * sizeof(float)) > strides_[(size_t) r]) {
        throw std::logic_error("engine: the slot pool has no bias region " + std::to_string(which) +
                               " that holds " + std::to_string(like->ne[0]) + " floats");
    }
    const int64_t n = buffer_slots(b), S = n + 1;
    const ggml_tensor * t = bufs_[(size_t) b];
    ggml_tensor * v = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, like->ne[0], S);
    v->nb[1] = (size_t) strides_[(size_t) r];
    v->nb[2] = v->nb[1] * (size_t) S;
    v->nb[3] = v->nb[2];
    v->data = (char *) t->data + region_base(r, n);
    v->buffer = t->buffer;
    return v;
}

ggml_tensor * SlotPool::scale_view(ggml_context * ctx, int which, int b) const {
    const int r = 6 + which;
    if (which < 0 || which > 2 || strides_[(size_t) r] != (int64_t) sizeof(float)) {
        throw std::logic_error("engine: the slot pool has no scale region " + std::to_string(which));
    }
    const int64_t n = buffer_slots(b);
    const ggml_tensor * t = bufs_[(size_t) b];
    ggml_tensor * v = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n + 1);
    v->data = (char *) t->data + region_base(r, n);
    v->buffer = t->buffer;
    return v;
}

}  // namespace hybrimoe
