#include "runtime/expert_files.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/mman.h>
#include <unistd.h>

namespace hybrimoe {

namespace {

int64_t mtime_ns(const struct stat & st) {
    return (int64_t) st.st_mtim.tv_sec * 1000000000LL + (int64_t) st.st_mtim.tv_nsec;
}

}  // namespace

void ExpertFiles::validate(const std::vector<std::array<int64_t, 3>> & expert_bytes, int n_expert,
                           const std::string & who) const {
    const size_t L = expert_bytes.size();
    if (file_of.size() != L || offset_of.size() != L) {
        throw std::invalid_argument(who + ": one file index and offset per MoE layer and matrix");
    }
    if (files.empty() || file_sizes.size() != files.size() || file_mtimes_ns.size() != files.size()) {
        throw std::invalid_argument(who + ": one size and modification time per model file");
    }
    for (size_t l = 0; l < L; ++l) {
        for (size_t i = 0; i < 3; ++i) {
            const int32_t f = file_of[l][i];
            if (f < -1 || f >= (int32_t) files.size()) throw std::invalid_argument(who + ": bad file index");
            if ((f >= 0) != (expert_bytes[l][i] > 0) || (f >= 0 && offset_of[l][i] < 0)) {
                throw std::invalid_argument(who + ": MoE layer " + std::to_string(l) +
                                            " has a matrix without a file range, or a range without a matrix");
            }
            const int64_t end = offset_of[l][i] + expert_bytes[l][i] * n_expert;
            if (f >= 0 && end > file_sizes[(size_t) f]) {
                throw std::invalid_argument(who + ": MoE layer " + std::to_string(l) + "'s experts end at byte " +
                                            std::to_string(end) + ", past the end of " + files[(size_t) f] + " (" +
                                            std::to_string(file_sizes[(size_t) f]) + " bytes)");
            }
        }
    }
}

std::string ExpertFiles::change(size_t f, int fd, struct stat & st) const {
    if (fstat(fd, &st) != 0) return std::string("cannot stat it: ") + std::strerror(errno);
    if ((int64_t) st.st_size != file_sizes[f]) {
        return "it has " + std::to_string((int64_t) st.st_size) + " bytes, " + std::to_string(file_sizes[f]) +
               " when the model was loaded";
    }
    if (file_mtimes_ns[f] != 0 && mtime_ns(st) != file_mtimes_ns[f]) {
        return "it was modified after the model was loaded";
    }
    return "";
}

MappedExperts::MappedExperts(const ExpertFiles & where, const std::vector<std::array<int64_t, 3>> & expert_bytes,
                             int n_expert)
    : where_(where), expert_bytes_(expert_bytes) {
    where_.validate(expert_bytes_, n_expert, "engine");
    for (size_t f = 0; f < where_.files.size(); ++f) {
        const std::string & path = where_.files[f];
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        std::string why;
        struct stat st {};
        if (fd < 0) {
            why = std::string("cannot open it: ") + std::strerror(errno);
        } else {
            why = where_.change(f, fd, st);
        }
        void * p = MAP_FAILED;
        if (why.empty()) {
            p = mmap(nullptr, (size_t) st.st_size, PROT_READ, MAP_SHARED, fd, 0);
            if (p == MAP_FAILED) why = std::string("cannot map it: ") + std::strerror(errno);
        }
        if (fd >= 0) ::close(fd);  // the mapping keeps the file
        if (!why.empty()) {
            for (size_t g = 0; g < maps_.size(); ++g) munmap((void *) maps_[g], map_bytes_[g]);
            throw std::runtime_error("engine: the experts' file " + path + ": " + why + " (load the model again)");
        }
        // a GPU copy reads one expert at a time, in the router's order: no read-around on a page not in RAM
        madvise(p, (size_t) st.st_size, MADV_RANDOM);
        maps_.push_back((const uint8_t *) p);
        map_bytes_.push_back((size_t) st.st_size);
    }
}

MappedExperts::~MappedExperts() {
    for (size_t f = 0; f < maps_.size(); ++f) munmap((void *) maps_[f], map_bytes_[f]);
}

const uint8_t * MappedExperts::matrix(int layer, int region, int expert) const {
    const int32_t f = where_.file_of[(size_t) layer][(size_t) region];
    if (f < 0) return nullptr;
    const int64_t off = where_.offset_of[(size_t) layer][(size_t) region] +
                        expert_bytes_[(size_t) layer][(size_t) region] * expert;
    return maps_[(size_t) f] + off;
}

}  // namespace hybrimoe
